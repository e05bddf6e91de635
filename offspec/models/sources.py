"""Turning a model spec from the user into a local Hugging Face directory ready for `from_pretrained`.

Spec forms, tried in this order:

* None or "default"        the built-in default pair member for the role (assembled and converted once);
* an existing directory     used as is when it has config.json;
* a path to a `.gguf` file  converted once into `<cache_dir>/models/` (see convert.py): its weights stay in their
                            ggml blocks (a weight store), or become float32 where the layout cannot be imported;
* `org/name`                a Hugging Face hub id, taken from the local hub cache; downloaded only when
                            HF_HUB_OFFLINE is not set;
* `org/name:file.gguf`      one GGUF file of a hub repo, fetched the same way, then converted once;
* `self` or `self:Q2_K`     (a draft only) the target's own GGUF requantized to Q3_K (or Q2_K), built once into
                            `<cache_dir>/self/` (self_draft.py), then located as a draft .gguf.

`locate_model` finds a model without converting anything (a GGUF is only located); `convert_located` converts
it; `resolve_model` does both. `offspec.models.loading.load_pair` reads the two tokenizers in between (a draft of
another tokenizer proposes through the text mapping, offspec/spec/xvocab.py), before any conversion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.store import entry
from offspec.util.hf import hub_cache_dir, hub_offline, quiet_transformers

from . import convert, default_pair
from .gguf_check import check_gguf
from .self_draft import self_copy, self_draft_type

ROLES = ("target", "draft")
EXPECTED = ("a Hugging Face model directory (with config.json), a .gguf file, a hub id like org/name, "
            "or 'default'")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<file>[^:]+\.gguf))?$")
# What a download of a plain (non-GGUF) hub model fetches: config, safetensors weights, tokenizer.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model on disk: `path` is a local directory with config.json and the tokenizer.

    `weights` says how its weights are stored: "hf" (a transformers checkpoint in `path`), "ggml" (offspec's
    weight store in `path/weights`, the GGUF's own blocks) or "float32" (a converted float checkpoint).
    A located but not yet converted GGUF has `gguf` set (and `path` is the GGUF file)."""

    name: str  # display name
    path: Path
    kind: str  # "default" | "local" | "gguf" | "hub"
    weights: str = "hf"
    gguf: Optional[Path] = None  # a GGUF to convert (convert_located)
    key: str = ""  # its cache key
    source: str = ""  # recorded in the converted entry's manifest

    @property
    def store(self) -> Optional[Path]:
        """The weight store directory of a converted GGUF ("ggml" weights), else None."""
        return self.path / "weights" if self.weights == "ggml" and self.gguf is None else None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_gguf_file(path: Path, role: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise OffspecError(f"cannot read {role} model file {path}: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise OffspecError(f"{role} model file {path} is not a GGUF file (bad magic bytes); "
                           f"it may be truncated or corrupt: download it again")


def _locate_gguf(path: Path, role: str, *, name: str, kind: str, source: str) -> ResolvedModel:
    _check_gguf_file(path, role)
    key = entry.gguf_key(path)
    if not entry.converted_dir(key).is_dir():  # converted before: its architecture and types were read then
        check_gguf(path, role)  # an architecture or a type no code path reads: one line, nothing written
    return ResolvedModel(name=name, path=path, kind=kind, gguf=path, key=key, source=source)


def _locate_default(role: str, progress: ProgressFn) -> ResolvedModel:
    spec = default_pair.default_model(role)
    gguf = default_pair.ensure_gguf(spec, progress=progress)
    return ResolvedModel(name=spec.name, path=gguf, kind="default", gguf=gguf, key=spec.key,
                         source=f"default {role}: {spec.name}")


def convert_located(located: ResolvedModel, progress: ProgressFn = no_progress) -> ResolvedModel:
    """Convert a located GGUF (once; see convert.py); anything else is returned as it is."""
    if located.gguf is None:
        return located
    directory = convert.ensure_converted(located.gguf, key=located.key, source=located.source, name=located.name,
                                         progress=progress)
    return ResolvedModel(name=located.name, path=directory, kind=located.kind,
                         weights=entry.entry_weights(directory))


def _resolve_directory(path: Path, spec: str, role: str) -> ResolvedModel:
    if (path / "config.json").is_file():
        return ResolvedModel(name=path.resolve().name or spec, path=path.resolve(), kind="local")
    ggufs = sorted(path.glob("*.gguf"))
    hint = f"; to use a GGUF pass the file itself, e.g. {ggufs[0]}" if ggufs else ""
    raise OffspecError(f"{role} model directory {spec!r} has no config.json; expected {EXPECTED}{hint}")


def _not_cached_error(repo: str, role: str, file: Optional[str], reason: str) -> OffspecError:
    what = f"{repo}:{file}" if file else repo
    args = f"{repo} {file}" if file else repo
    return OffspecError(
        f"{role} model {what!r} is not in the Hugging Face cache ({hub_cache_dir()}) and {reason}; "
        f"on a connected machine run `hf download {args}` (older hub versions: `huggingface-cli download {args}`) "
        f"and copy the cache here, or pass a local model directory or .gguf file"
    )


def _locate_hub(repo: str, file: Optional[str], spec: str, role: str, progress: ProgressFn,
                path_like: bool) -> ResolvedModel:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = str(hub_cache_dir())
    what = f"{repo}:{file}" if file else repo
    local: Optional[str] = None
    try:
        with quiet_transformers():
            if file:
                local = hf_hub_download(repo, file, cache_dir=cache, local_files_only=True)
            else:
                local = snapshot_download(repo, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        local = None
    except Exception as exc:  # a broken cache entry
        raise OffspecError(f"cannot read {role} model {what!r} from the Hugging Face cache ({cache}): "
                           f"{_one_line(exc)}") from exc
    if local is None:
        elsewhere = f"; there is no local path {spec!r} either" if path_like else ""
        if hub_offline():
            raise _not_cached_error(repo, role, file, f"downloads are off (HF_HUB_OFFLINE is set){elsewhere}")
        progress(ProgressEvent("download", f"downloading {what} from the Hugging Face hub"))
        try:
            with quiet_transformers():
                if file:
                    local = hf_hub_download(repo, file, cache_dir=cache)
                else:
                    local = snapshot_download(repo, cache_dir=cache, allow_patterns=_HUB_PATTERNS)
        except Exception as exc:
            raise _not_cached_error(repo, role, file,
                                    f"downloading it failed ({_one_line(exc)}){elsewhere}") from exc
        progress(ProgressEvent("download", f"downloaded {what}", finished=True))
    if file:
        return _locate_gguf(Path(local), role, name=what, kind="hub", source=f"hub {what}")
    directory = Path(local)
    if not (directory / "config.json").is_file():
        raise OffspecError(f"{role} model {repo!r} in the Hugging Face cache ({directory}) has no config.json; "
                           f"it is incomplete or not a transformers model: run `hf download {repo}` again, "
                           f"or use org/name:file.gguf for a GGUF repo")
    return ResolvedModel(name=repo, path=directory, kind="hub")


def _locate_self(type_name: str, target: Optional[ResolvedModel], progress: ProgressFn) -> ResolvedModel:
    """The draft `self`: the copy of the target's GGUF (built once), located as a draft .gguf."""
    if target is None:
        raise OffspecError("`self` names a draft made from the target: use it as --draft self, with a --target")
    if target.gguf is None:
        raise OffspecError(f"--draft self needs a GGUF target for now, and {target.name} is a Hugging Face "
                           f"checkpoint: pass the target as a .gguf file, or name a draft model (--draft "
                           f"small.gguf) or --draft none")
    copy = self_copy(target.gguf, type_name, progress)
    return _locate_gguf(copy, "draft", name=f"{target.name} (self {type_name})", kind="gguf",
                        source=f"self draft ({type_name}) of {target.source or target.gguf}")


def locate_model(spec: Optional[str], role: str, *, progress: ProgressFn = no_progress,
                 target: Optional[ResolvedModel] = None) -> ResolvedModel:
    """Find the model named by `spec` for `role` ("target" or "draft") without converting it.

    The default pair's GGUF is assembled (once) from its chunk packages here, and a `self` draft (the located
    `target` requantized) built once. Raises OffspecError with one line saying what was expected when `spec`
    names nothing usable.
    """
    if role not in ROLES:
        raise OffspecError(f"unknown model role {role!r}; expected one of {', '.join(ROLES)}")
    if spec is None or spec.strip().lower() in ("", "default"):
        return _locate_default(role, progress)
    self_type = self_draft_type(spec)
    if self_type is not None:
        if role != "draft":
            raise OffspecError(f"{role} model {spec.strip()!r}: `self` names a draft made from the target; "
                               f"use --draft self, with a --target")
        return _locate_self(self_type, target, progress)
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_directory(path, spec, role)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            resolved = path.resolve()
            return _locate_gguf(resolved, role, name=resolved.stem, kind="gguf", source=f"file {resolved}")
        raise OffspecError(f"{role} model {spec!r} is a file but not a .gguf; expected {EXPECTED}")
    match = _HUB_ID.match(spec)
    if match and not spec.startswith(("./", "../", "~")) and (match["file"] or not spec.lower().endswith(".gguf")):
        path_like = path.parent.is_dir() and path.parent != Path(".")  # e.g. "models/typo"
        return _locate_hub(match["repo"], match["file"], spec, role, progress, path_like)
    raise OffspecError(f"{role} model {spec!r} not found: no such file or directory; expected {EXPECTED}")


def resolve_model(spec: Optional[str], role: str, *, progress: ProgressFn = no_progress) -> ResolvedModel:
    """Locate the model named by `spec` and convert it if it is a GGUF (see locate_model, convert_located)."""
    return convert_located(locate_model(spec, role, progress=progress), progress)
