"""A draft for any target: which draft model serves a target the user named without a `--draft`.

In this order (`choose_draft`):
1. a cached draft with the same tokenizer: the smallest converted entry in `<cache>/models/` whose tokenizer has the
   target's vocabulary and end/begin ids, smaller than the target and not the target itself;
2. the default draft (offspec/models/default_pair.py), where it is installed and smaller than the target: through
   the text mapping where its tokenizer differs (offspec/spec/xvocab.py);
3. none: suffix drafts alone (as `--draft none`).

The choice comes with a line for the load display that says which and why. `tokenizer_difference` is the
comparison: None when a draft's tokens are the target's, else a few words on how they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from offspec.progress import ProgressFn, no_progress
from offspec.store.entry import (
    converted_dir,
    entry_weights,
    read_manifest,
    verify_entry,
)
from offspec.util.hf import quiet_transformers
from offspec.util.paths import cache_dir

from . import default_pair
from .sources import ResolvedModel, locate_model


def tokenizer_difference(target_tok: Any, draft_tok: Any) -> Optional[str]:
    """A short description of how two tokenizers differ, or None when they agree (vocabulary, eos and bos ids)."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        if len(tv) != len(dv):
            return f"{len(tv):,} vs {len(dv):,} tokens"
        token = next(t for t in sorted(tv) if tv[t] != dv.get(t))
        return f"token {token!r} has id {tv[token]} vs {dv.get(token)}"
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            return f"{attr.removesuffix('_id').replace('_', ' ')} id {a} vs {b}"
    return None


@dataclass(frozen=True)
class DraftChoice:
    draft: Optional[ResolvedModel]  # None: no draft model (suffix drafts only)
    line: str  # for the load display: which, and why
    tokenizer: Any = None  # the draft's tokenizer where the choice loaded it


def _bytes_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _entry_name(directory: Path, manifest: dict) -> str:
    """A cached entry's display name, from the source its manifest records."""
    source = str(manifest.get("source", ""))
    if source.startswith("file "):
        return Path(source[5:]).stem
    if source.startswith("default ") and ": " in source:
        return source.split(": ", 1)[1]
    if source.startswith("hub "):
        return source[4:]
    return directory.name


def cached_entries(exclude: Optional[Path] = None, root: Optional[Path] = None) -> list[tuple[int, ResolvedModel]]:
    """(bytes on disk, model) of every complete converted entry with a saved tokenizer, smallest first."""
    models = (root if root is not None else cache_dir()) / "models"
    found = []
    for directory in sorted(models.iterdir()) if models.is_dir() else ():
        manifest = read_manifest(directory)
        if manifest is None or (directory / "tokenizer.json").is_file() is False:
            continue
        if exclude is not None and directory.resolve() == exclude.resolve():
            continue
        if verify_entry(directory) is not None:
            continue
        size = sum(int(f.get("size", 0)) for f in manifest.get("files", []))
        model = ResolvedModel(name=_entry_name(directory, manifest), path=directory, kind="cached",
                              weights=entry_weights(directory))
        found.append((size, model))
    return sorted(found, key=lambda item: (item[0], str(item[1].path)))


def _vocab_size(directory: Path) -> Optional[int]:
    """The number of tokens of an entry's saved tokenizer (read with `tokenizers` alone: cheap), None if unreadable."""
    from tokenizers import (
        Tokenizer,  # lazy: only a target without a draft looks through the cache
    )

    try:
        return Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception:  # tokenizers raises a bare Exception for a file it cannot parse: that entry is no candidate
        return None


def _default_draft_installed() -> bool:
    spec = default_pair.DEFAULT_DRAFT
    entry = converted_dir(spec.key)
    return (default_pair.assembled_gguf(spec) is not None or (entry.is_dir() and verify_entry(entry) is None)
            or default_pair.installed_chunk_bytes(spec) == spec.size)


def choose_draft(target: ResolvedModel, target_tok: Any, load_tokenizer: Callable[[ResolvedModel], Any],
                 root: Optional[Path] = None, progress: ProgressFn = no_progress) -> DraftChoice:
    """The draft for `target` (located; `target_tok` its tokenizer) when none was named (see the module doc).
    `load_tokenizer` is offspec.models.loading.load_tokenizer."""
    own = converted_dir(target.key, root) if target.key else target.path
    size = _bytes_on_disk(target.gguf if target.gguf is not None else target.path)
    count = len(target_tok)
    for entry_size, model in cached_entries(exclude=own, root=root):
        if entry_size >= size or _vocab_size(model.path) != count:
            continue
        with quiet_transformers():
            tok = load_tokenizer(model)
        if tokenizer_difference(target_tok, tok) is None:
            return DraftChoice(model, f"draft {model.name}: the smallest cached model with the tokenizer of "
                                      f"{target.name} ({model.path})", tok)
    spec = default_pair.DEFAULT_DRAFT
    if spec.size < size and _default_draft_installed():
        return DraftChoice(locate_model(None, "draft", progress=progress),
                           f"draft {spec.name}: no smaller cached model has the tokenizer of {target.name}, so the "
                           f"default draft")
    why = "the default draft is not installed" if spec.size < size else "the default draft is not smaller"
    return DraftChoice(None, f"no draft model: no smaller cached model has the tokenizer of {target.name}, and {why}; "
                             f"suffix drafts only (as --draft none; name a draft with --draft)")
