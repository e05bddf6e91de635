"""One-time conversion of a GGUF file into the runtime's own format: a Hugging Face directory.

`ensure_converted` dequantizes the GGUF with transformers' GGUF support into the compute dtype and
saves it as `<cache_dir>/models/<key>-<dtype>/` (config.json, generation_config.json, *.safetensors,
tokenizer files). The directory is built next to its destination under a temp name; the manifest
`offspec-manifest.json` (format version, source, dtype, every file's name, size and sha256) is written
last, then the directory is renamed into place. A directory whose manifest is missing, of another
format, or lists a file that is absent or of another size is partial or corrupt: it is removed and
rebuilt, never used.

Keys: the default pair uses its content hash (`ChunkedModel.key`); a user's `.gguf` file uses
`gguf_key(path)`, derived from its resolved path, size and mtime (no hashing of gigabytes at start-up).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from .errors import OffspecError
from .paths import cache_dir
from .progress import ProgressEvent, ProgressFn, no_progress

MANIFEST = "offspec-manifest.json"
FORMAT_VERSION = 1
STALE_TEMP_SECONDS = 3600  # a temp dir untouched this long belongs to a dead conversion
BLOCK = 8 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:60] or "model"


def gguf_key(path: Path) -> str:
    """Cache key of a user-given GGUF: its stem plus a hash of resolved path, size and mtime."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    ident = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{_slug(resolved.stem)}-{hashlib.sha256(ident).hexdigest()[:12]}"


def converted_dir(key: str, dtype: torch.dtype, root: Optional[Path] = None) -> Path:
    """`<cache_dir>/models/<key>-<dtype>`."""
    return (root if root is not None else cache_dir()) / "models" / f"{key}-{dtype_name(dtype)}"


# ----------------------------------------------------------------------------------------------------------
# Keeping transformers quiet (our UI reports progress)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' / huggingface_hub's progress bars, warnings and info logs; errors still raise."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hub_bars_off = are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()


@contextmanager
def _gguf_tensor_progress(progress: ProgressFn, message: str) -> Iterator[None]:
    """Turn transformers' GGUF de-quantization tqdm bar into our progress events (tensors done / total).

    transformers' legacy GGUF loader iterates `tqdm(reader.tensors, ...)` from its module namespace; we
    swap that name for a silent wrapper for the duration. If the internals differ, we just lose the detail.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - depends on the transformers version
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def reporting(iterable: Iterable[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        for done, item in enumerate(items):
            progress(ProgressEvent("convert", message, done, len(items)))
            yield item
        progress(ProgressEvent("convert", message, len(items), len(items)))

    if original is not None:
        gguf_utils.tqdm = reporting
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original


# ----------------------------------------------------------------------------------------------------------
# Manifest


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path) -> Optional[dict]:
    """The parsed manifest of a converted dir, or None when it is missing or unreadable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(directory: Path, dtype: Optional[torch.dtype] = None) -> bool:
    """True when `directory` has a current-format manifest and every listed file exists with its size."""
    manifest = read_manifest(directory)
    if manifest is None or manifest.get("format") != FORMAT_VERSION:
        return False
    if dtype is not None and manifest.get("dtype") != dtype_name(dtype):
        return False
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return False
    try:
        return all((directory / f["name"]).stat().st_size == f["size"] for f in files)
    except (OSError, KeyError, TypeError):
        return False


def _write_manifest(directory: Path, source: str, dtype: torch.dtype, progress: ProgressFn, message: str) -> None:
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    files = []
    for i, name in enumerate(names):
        progress(ProgressEvent("convert", message, i, len(names)))
        path = directory / name
        files.append({"name": name, "size": path.stat().st_size, "sha256": _file_sha256(path)})
    import transformers

    manifest = {
        "format": FORMAT_VERSION, "source": source, "dtype": dtype_name(dtype), "created": time.time(),
        "transformers": transformers.__version__, "files": files,
    }
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------
# Conversion


def _strip_gguf_quantization(model: Any) -> None:
    """Make a GGUF-loaded (de-quantized) model save as a plain one: drop the GGUF quantizer and its config."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _remove_tree(path: Path) -> None:
    """Remove a directory: renamed aside first, so a half-deleted tree never sits at a usable path."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temps(parent: Path) -> None:
    now = time.time()
    for leftover in list(parent.glob(".*.tmp")) + list(parent.glob(".*.trash-*")):
        try:
            if leftover.is_dir() and now - leftover.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _build(gguf: Path, tmp: Path, dtype: torch.dtype, source: str, name: str, progress: ProgressFn) -> None:
    """Write tokenizer, config and weights of `gguf` into the empty dir `tmp`, manifest last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with quiet_transformers():
        progress(ProgressEvent("convert", f"reading the tokenizer of {name}"))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        del tokenizer
        message = f"de-quantizing {name} to {dtype_name(dtype)}"
        progress(ProgressEvent("convert", message))
        with _gguf_tensor_progress(progress, message):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
        _strip_gguf_quantization(model)
        progress(ProgressEvent("convert", f"writing {name} as safetensors"))
        model.save_pretrained(tmp)
    del model
    gc.collect()
    _write_manifest(tmp, source, dtype, progress, f"checksumming {name}")


def ensure_converted(gguf: Path, *, key: str, dtype: torch.dtype, source: str, name: Optional[str] = None,
                     progress: ProgressFn = no_progress, root: Optional[Path] = None) -> Path:
    """Return the converted HF directory of `gguf` for `dtype`, converting it first unless complete.

    `key` names the cache entry (see module doc); `source` is recorded in the manifest; `name` is
    the display name used in progress messages; `root` overrides `cache_dir()`.
    """
    dest = converted_dir(key, dtype, root)
    if is_complete(dest, dtype):
        return dest
    name = name or Path(gguf).name
    gguf = Path(gguf)
    if not gguf.is_file():
        raise OffspecError(f"GGUF file {gguf} not found")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest.parent)
    _remove_tree(dest)  # partial or corrupt: never used
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    progress(ProgressEvent("convert", f"converting {name} (one time)"))
    try:
        _build(gguf, tmp, dtype, source, name, progress)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest, dtype):  # not a concurrent conversion that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OffspecError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except MemoryError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OffspecError(f"out of memory while converting {name}; close other programs or use a smaller "
                           f"dtype (--dtype bfloat16)") from exc
    except Exception as exc:  # transformers / gguf / disk errors: one line for the user
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OffspecError(f"cannot convert {gguf} into a model directory: {reason}") from exc
    progress(ProgressEvent("convert", f"converted {name}", finished=True))
    return dest
