"""What offspec's cache holds, and removing it: the library side of `offspec models`.

Three kinds of rows, each named by its directory or key (the name `remove` takes):

* `converted`: `<cache_dir>/models/<key>/`, a GGUF converted once (offspec/models/convert.py). Its family is the
  `model_type` of its config.json, its weight types come from its manifest (ggml types, most bytes first), and its
  tokenizer fingerprint is a hash of its vocabulary (offspec/models/fingerprint.py): entries with the same
  fingerprint share a tokenizer, so either can draft for the other.
* `gguf`: the default pair member's GGUF in `<cache_dir>/gguf/` (downloaded or assembled, then verified). It is
  shown on its converted entry's row (`gguf_size`), or as a row of its own when that entry is gone (named by the
  entry's key). Any other GGUF there (a default of an earlier version) is a row named by its file name.
* `packed`: `<cache_dir>/offload/<set>/`, the per-layer files a float checkpoint was packed (or quantized) into for
  streaming (offspec/offload/model.py); made again when it is needed.
* `self`: `<cache_dir>/self/<name>.gguf`, a target's low-bit copy that `--draft self` drafts with
  (offspec/models/self_draft.py), named by its file; made again when it is needed. Its converted entry is a row of
  its own (`converted`, its source the copy).

Names starting with "." (temps of a build, of a download or of a removal in progress) are not listed.

`remove` renames a directory aside (`.<name>.trash-<pid>-<ns>`) before deleting it, so nothing half-deleted stays
at a usable path; an interrupted removal leaves only the hidden trash, which the next conversion removes. A
default member's GGUF goes only when asked (`with_gguf`): its sidecar first, so a half-removed GGUF is never trusted.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from offspec.errors import OffspecError
from offspec.store.entry import FORMAT_VERSION, read_manifest
from offspec.util.paths import cache_dir

from . import default_pair
from .fingerprint import file_fingerprint

PACKED_MANIFEST = "manifest.json"  # offspec/store/packed.py MANIFEST (not imported: that module loads torch)


@dataclass(frozen=True)
class CachedModel:
    """One row of the cache listing."""

    name: str  # what `offspec models rm` takes: the entry's directory name (a default member: its key)
    kind: str  # "converted" | "gguf" | "packed" | "self"
    path: str  # the entry directory (converted, packed) or the GGUF file (gguf)
    size: int  # bytes on disk of `path`
    family: str = ""  # config.json model_type ("qwen2", "llama", ...); "" when unknown
    weight_types: tuple[str, ...] = ()  # "Q4_K", "Q6_K" ... most bytes first; "float32" ...
    tokenizer: str = ""  # vocabulary fingerprint (16 hex digits); "" when unknown
    source: str = ""  # where it came from (the manifest's source)
    status: str = "ok"  # "ok", or what makes it unusable (it is rebuilt when next needed)
    default_role: str = ""  # "target" | "draft" for a member of the built-in default pair
    gguf: str = ""  # a default member's GGUF kept by offspec ("" when none)
    gguf_size: int = 0

    @property
    def total_size(self) -> int:
        return self.size + self.gguf_size


def _tree_size(path: Path) -> int:
    total = 0
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _weight_types(manifest: dict) -> tuple[str, ...]:
    types = manifest.get("types")
    if isinstance(types, dict) and types:
        return tuple(sorted(types, key=lambda t: (-int(types[t]) if isinstance(types[t], int) else 0, t)))
    weights = manifest.get("weights")
    return (str(weights),) if weights else ()


def _status(manifest: Optional[dict]) -> str:
    if manifest is None:
        return "incomplete (no manifest)"
    if manifest.get("format") != FORMAT_VERSION:
        return f"made by another version of offspec (format {manifest.get('format')})"
    return "ok"


def _defaults(root: Path) -> dict[str, tuple[str, Path]]:
    """key -> (role, where its GGUF lives) for the members of the default pair."""
    out = {}
    for role in default_pair.ROLES:
        spec = default_pair.default_model(role)
        out[spec.key] = (role, default_pair.gguf_path(spec, root))
    return out


def _converted(directory: Path, defaults: dict[str, tuple[str, Path]]) -> CachedModel:
    manifest = read_manifest(directory)
    config = _read_json(directory / "config.json") or {}
    role, gguf = defaults.get(directory.name, ("", None))
    has_gguf = gguf is not None and gguf.is_file()
    return CachedModel(
        name=directory.name, kind="converted", path=str(directory), size=_tree_size(directory),
        family=str(config.get("model_type") or ""), weight_types=_weight_types(manifest or {}),
        tokenizer=file_fingerprint(directory) or "", source=str((manifest or {}).get("source", "")),
        status=_status(manifest), default_role=role,
        gguf=str(gguf) if has_gguf else "", gguf_size=_tree_size(gguf) if has_gguf else 0)


def _packed(directory: Path) -> CachedModel:
    manifest = _read_json(directory / PACKED_MANIFEST)
    key = (manifest or {}).get("key") if isinstance((manifest or {}).get("key"), dict) else {}
    types = tuple(str(key[k]) for k in ("quant", "dtype") if key.get(k) and key.get(k) != "none")
    return CachedModel(
        name=directory.name, kind="packed", path=str(directory), size=_tree_size(directory), weight_types=types,
        source=f"packed layers of {key['model']}" if key.get("model") else "packed layers",
        status="ok" if manifest is not None else "incomplete (no manifest)")


def _self_copy(copy: Path) -> CachedModel:
    from .self_draft import is_built

    type_name = copy.stem.split("-")[-2].upper()  # <stem>-<path hash>-<target hash>-<type>-v<FORMAT>
    return CachedModel(name=copy.name, kind="self", path=str(copy), size=_tree_size(copy), weight_types=(type_name,),
                       source="a target's copy for --draft self",
                       status="ok" if is_built(copy) else "incomplete (rebuilt when next used)")


def list_cache(root: Optional[Path] = None) -> list[CachedModel]:
    """Every model in the cache (`root`, default `cache_dir()`): converted entries, GGUFs without one, packed
    sets, self-draft copies, each kind by name."""
    root = root if root is not None else cache_dir()
    defaults = _defaults(root)
    rows: list[CachedModel] = []
    models = root / "models"
    seen = set()
    for directory in sorted(models.iterdir()) if models.is_dir() else []:
        if directory.name.startswith(".") or not directory.is_dir():
            continue
        rows.append(_converted(directory, defaults))
        seen.add(directory.name)
    for key, (role, gguf) in defaults.items():
        if key not in seen and gguf.is_file():
            spec = default_pair.default_model(role)
            rows.append(CachedModel(
                name=key, kind="gguf", path=str(gguf), size=0, source=f"default {role}: {spec.name}",
                status="not converted (the next start converts it)", default_role=role, gguf=str(gguf),
                gguf_size=_tree_size(gguf)))
    known = {gguf for _, gguf in defaults.values()}
    gguf_dir = root / "gguf"
    for gguf in sorted(gguf_dir.glob("*.gguf")) if gguf_dir.is_dir() else []:
        if gguf not in known and gguf.is_file():  # e.g. a default of an earlier version of offspec
            rows.append(CachedModel(name=gguf.name, kind="gguf", path=str(gguf), size=0,
                                    status="not a default pair member of this version", gguf=str(gguf),
                                    gguf_size=_tree_size(gguf)))
    offload = root / "offload"
    for directory in sorted(offload.iterdir()) if offload.is_dir() else []:
        if not directory.name.startswith(".") and directory.is_dir():
            rows.append(_packed(directory))
    copies = root / "self"
    for copy in sorted(copies.glob("*.gguf")) if copies.is_dir() else []:
        if not copy.name.startswith(".") and copy.is_file():
            rows.append(_self_copy(copy))
    return rows


def shared_tokenizers(rows: list[CachedModel]) -> dict[str, list[str]]:
    """Fingerprint -> names of the rows with that tokenizer, for the fingerprints two or more rows share."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        if row.tokenizer:
            groups.setdefault(row.tokenizer, []).append(row.name)
    return {fp: names for fp, names in groups.items() if len(names) > 1}


def as_dict(row: CachedModel) -> dict:
    """A row as plain JSON types (total_size included)."""
    return {**asdict(row), "weight_types": list(row.weight_types), "total_size": row.total_size}


def find(rows: list[CachedModel], name: str) -> CachedModel:
    """The row named exactly `name`; a one-line OffspecError (with the closest names) when there is none."""
    for row in rows:
        if row.name == name:
            return row
    close = difflib.get_close_matches(name, [r.name for r in rows], n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise OffspecError(f"no cached model named {name!r}{hint}; `offspec models` lists them by their exact names")


def _remove_tree(path: Path) -> None:
    """Rename `path` aside (hidden, tagged with this process), then delete it."""
    trash = path.with_name(f".{path.name}.trash-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def _remove_file(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def remove(row: CachedModel, *, with_gguf: bool = False) -> int:
    """Delete what `row` names (its entry; a default member's GGUF too when `with_gguf`); return the bytes freed.

    A `gguf` row (a default member's GGUF alone) needs `with_gguf`. Raises a one-line OffspecError when something
    cannot be removed (what was removed before stays removed; nothing is left half-usable)."""
    if row.kind == "gguf" and not with_gguf:
        what = f"the GGUF of the default {row.default_role} model, downloaded or assembled once" if row.default_role \
            else "a GGUF in offspec's cache"
        again = " (the next start fetches it again)" if row.default_role else ""
        raise OffspecError(f"{row.name} is {what} ({row.gguf_size:,} bytes); to remove it, add --with-gguf{again}")
    freed = 0
    try:
        if row.kind in ("converted", "packed"):
            _remove_tree(Path(row.path))
            freed += row.size
        if row.kind == "self":  # the marker first: a copy without it is never taken as complete
            from .self_draft import marker_path

            _remove_file(marker_path(Path(row.path)))
            _remove_file(Path(row.path))
            freed += row.size
        if with_gguf and row.gguf:
            gguf = Path(row.gguf)
            _remove_file(gguf.with_name(gguf.name + ".verified"))  # first: a GGUF without it is never trusted as is
            _remove_file(gguf)
            freed += row.gguf_size
    except FileNotFoundError:
        pass  # removed meanwhile (another offspec)
    except OSError as exc:
        raise OffspecError(f"cannot remove {row.name}: {exc.strerror or exc} ({exc.filename or row.path}); "
                           f"check the permissions of {Path(row.path).parent}") from exc
    return freed
