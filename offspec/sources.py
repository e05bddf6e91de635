"""Turning a model spec from the user into a local Hugging Face directory ready for `from_pretrained`.

Spec forms, tried in this order:

* None or "default"        the built-in default pair member for the role (assembled and converted once);
* an existing directory     used as is when it has config.json;
* a path to a `.gguf` file  converted once into `<cache_dir>/models/` (see convert.py);
* `org/name`                a Hugging Face hub id, taken from the local hub cache; downloaded only when
                            HF_HUB_OFFLINE is not set;
* `org/name:file.gguf`      one GGUF file of a hub repo, fetched the same way, then converted once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import convert, default_pair
from .errors import OffspecError
from .progress import ProgressEvent, ProgressFn, no_progress

ROLES = ("target", "draft")
EXPECTED = ("a Hugging Face model directory (with config.json), a .gguf file, a hub id like org/name, "
            "or 'default'")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<file>[^:]+\.gguf))?$")
_TRUE = {"1", "true", "yes", "on"}
# What a download of a plain (non-GGUF) hub model fetches: config, safetensors weights, tokenizer.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model located on disk: `path` is a local HF directory ready for `from_pretrained`."""

    name: str  # display name
    path: Path
    kind: str  # "default" | "local" | "gguf" | "hub"


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read at call time."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment at call time (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


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


def _resolve_gguf(path: Path, role: str, dtype: torch.dtype, progress: ProgressFn, *, name: str,
                  kind: str, source: str) -> ResolvedModel:
    _check_gguf_file(path, role)
    directory = convert.ensure_converted(path, key=convert.gguf_key(path), dtype=dtype, source=source,
                                         name=name, progress=progress)
    return ResolvedModel(name=name, path=directory, kind=kind)


def _resolve_default(role: str, dtype: torch.dtype, progress: ProgressFn) -> ResolvedModel:
    spec = default_pair.default_model(role)
    gguf = default_pair.ensure_gguf(spec, progress=progress)
    directory = convert.ensure_converted(gguf, key=spec.key, dtype=dtype, source=f"default {role}: {spec.name}",
                                         name=spec.name, progress=progress)
    return ResolvedModel(name=spec.name, path=directory, kind="default")


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


def _resolve_hub(repo: str, file: Optional[str], spec: str, role: str, dtype: torch.dtype,
                 progress: ProgressFn, path_like: bool) -> ResolvedModel:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = str(hub_cache_dir())
    what = f"{repo}:{file}" if file else repo
    local: Optional[str] = None
    try:
        with convert.quiet_transformers():
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
            with convert.quiet_transformers():
                if file:
                    local = hf_hub_download(repo, file, cache_dir=cache)
                else:
                    local = snapshot_download(repo, cache_dir=cache, allow_patterns=_HUB_PATTERNS)
        except Exception as exc:
            raise _not_cached_error(repo, role, file,
                                    f"downloading it failed ({_one_line(exc)}){elsewhere}") from exc
        progress(ProgressEvent("download", f"downloaded {what}", finished=True))
    if file:
        return _resolve_gguf(Path(local), role, dtype, progress, name=what, kind="hub", source=f"hub {what}")
    directory = Path(local)
    if not (directory / "config.json").is_file():
        raise OffspecError(f"{role} model {repo!r} in the Hugging Face cache ({directory}) has no config.json; "
                           f"it is incomplete or not a transformers model: run `hf download {repo}` again, "
                           f"or use org/name:file.gguf for a GGUF repo")
    return ResolvedModel(name=repo, path=directory, kind="hub")


def resolve_model(spec: Optional[str], role: str, *, dtype: torch.dtype,
                  progress: ProgressFn = no_progress) -> ResolvedModel:
    """Locate (assembling, converting or fetching as needed) the model named by `spec` for `role`.

    `role` is "target" or "draft"; `dtype` is the compute dtype (GGUF files are converted into it).
    Raises OffspecError with one line saying what was expected when `spec` names nothing usable.
    """
    if role not in ROLES:
        raise OffspecError(f"unknown model role {role!r}; expected one of {', '.join(ROLES)}")
    if spec is None or spec.strip().lower() in ("", "default"):
        return _resolve_default(role, dtype, progress)
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_directory(path, spec, role)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            resolved = path.resolve()
            return _resolve_gguf(resolved, role, dtype, progress, name=resolved.stem, kind="gguf",
                                 source=f"file {resolved}")
        raise OffspecError(f"{role} model {spec!r} is a file but not a .gguf; expected {EXPECTED}")
    match = _HUB_ID.match(spec)
    if match and not spec.startswith(("./", "../", "~")) and (match["file"] or not spec.lower().endswith(".gguf")):
        path_like = path.parent.is_dir() and path.parent != Path(".")  # e.g. "models/typo"
        return _resolve_hub(match["repo"], match["file"], spec, role, dtype, progress, path_like)
    raise OffspecError(f"{role} model {spec!r} not found: no such file or directory; expected {EXPECTED}")
