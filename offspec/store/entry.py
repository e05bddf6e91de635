"""A converted model's cache entry: `<cache_dir>/models/<key>/` and its manifest.

The entry holds config.json, the tokenizer files, `weights/` (the packed store, offspec/store/packed.py) and
`offspec-manifest.json`, written last: format, source, how the weights are stored, and every file's size, mtime and
sha256. `verify_entry` checks an entry against its manifest; conversion (offspec/models/convert.py) writes it, and
loading and offloading read it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional

from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.files import atomic_write, remove_stale_temps, sha256_file
from offspec.util.paths import cache_dir

MANIFEST = "offspec-manifest.json"
FORMAT_VERSION = 3  # 1: float-only entries named <key>-<dtype> (removed when found); 2: GGUF tokenizers that
# could give a token an id past the vocabulary (Gemma-3's runs of spaces) or split a prompt otherwise than llama.cpp
WEIGHTS_DIR = "weights"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:60] or "model"


def gguf_key(path: Path) -> str:
    """Cache key of a user-given GGUF: its stem plus a hash of resolved path, size and mtime."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    ident = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{_slug(resolved.stem)}-{hashlib.sha256(ident).hexdigest()[:12]}"


def converted_dir(key: str, root: Optional[Path] = None) -> Path:
    """`<cache_dir>/models/<key>`."""
    return (root if root is not None else cache_dir()) / "models" / key


def store_key(key: str) -> dict:
    """The packed-store key of a converted entry (offspec.store.packed.open_store)."""
    return {"model": key, "source": key, "format": "ggml"}


def read_manifest(directory: Path) -> Optional[dict]:
    """The parsed manifest of a converted dir, or None when it is missing or unreadable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def entry_files(directory: Path) -> list[str]:
    """Every file of an entry, relative to it (the manifest excepted)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, manifest: dict) -> None:
    remove_stale_temps(directory)  # a manifest temp of a run killed while rewriting it
    atomic_write(directory / MANIFEST, lambda f: json.dump(manifest, f, indent=1), encoding="utf-8")  # fsync'd


def verify_entry(directory: Path, *, deep: bool = False, progress: ProgressFn = no_progress,
                 message: str = "") -> Optional[str]:
    """None when `directory` is a complete entry of the current format, else what is wrong.

    Sizes are always checked; a file is re-hashed when its mtime differs from the manifest's (or every file
    when `deep`). A file whose content still matches gets its new mtime recorded."""
    manifest = read_manifest(directory)
    if manifest is None:
        return "no manifest (missing or partial entry)"
    if manifest.get("format") != FORMAT_VERSION:
        return f"made by another version of offspec (format {manifest.get('format')})"
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return "the manifest lists no files"
    changed = False
    try:
        for i, f in enumerate(files):
            path = directory / f["name"]
            st = path.stat()
            if st.st_size != f["size"]:
                return f"{f['name']} is {st.st_size:,} bytes, expected {f['size']:,}"
            if deep or st.st_mtime_ns != f.get("mtime_ns"):
                progress(ProgressEvent("verify", message or f"verifying {directory.name}", i, len(files)))
                if sha256_file(path) != f["sha256"]:
                    return f"{f['name']} is damaged (its content changed since it was written)"
                if st.st_mtime_ns != f.get("mtime_ns"):
                    f["mtime_ns"] = st.st_mtime_ns
                    changed = True
    except FileNotFoundError as exc:
        return f"{Path(exc.filename).name} is missing"
    except (OSError, KeyError, TypeError) as exc:
        return f"unreadable ({exc})"
    if changed:
        try:
            write_manifest(directory, manifest)
        except OSError:
            pass  # a read-only cache: verified again next time
    if deep:
        progress(ProgressEvent("verify", message or f"verifying {directory.name}", len(files), len(files),
                               finished=True))
    return None


def entry_weights(directory: Path) -> str:
    """How a verified entry stores its weights: "ggml" (the weight store) or "float32" (safetensors)."""
    return (read_manifest(directory) or {}).get("weights", "float32")
