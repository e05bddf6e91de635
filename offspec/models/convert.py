"""One-time conversion of a GGUF file into offspec's cache: config, tokenizer and a weight store.

`ensure_converted` makes `<cache_dir>/models/<key>/`:
- config.json, generation_config.json and the tokenizer files (transformers reads them from the GGUF);
- `weights/`: the packed weight store (offspec/store/packed.py) holding every weight in the GGUF's own ggml
  blocks (offspec/formats/gguf_import.py): a Q4_K_M file stays Q4_K/Q6_K in the cache, in RAM, on SSD and in the
  kernels, at about the GGUF's size;
- for an architecture whose GGUF layout cannot be imported block for block, float32 safetensors instead
  (transformers de-quantizes it), said in the progress;
- `offspec-manifest.json`, written last: format, source, how the weights are stored, and every file's size,
  mtime and sha256.

The entry is built in a temp directory named after the building process, then renamed into place. A start
checks each file's size and mtime against the manifest and re-hashes the files whose mtime changed: a
damaged entry (wrong size, wrong content) is removed and rebuilt, never used; `verify_entry(deep=True)` re-hashes
everything (`offspec setup --verify`). Entries of the old float-only format (`<key>-float32` ...) are removed.
Temp directories of a build whose process is gone (Ctrl-C, kill -9) are removed at the next start.

Keys: the default pair uses its content hash (`ChunkedModel.key`); a user's `.gguf` file uses `gguf_key(path)`,
derived from its resolved path, size and mtime (no hashing of gigabytes at start-up).
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from offspec.errors import OffspecError
from offspec.formats.experts import expert_groups
from offspec.formats.gguf_config import complete_config, gguf_fields, gpt_oss_config, mixtral_config
from offspec.formats.gguf_import import (ImportUnsupported, check_every_tensor_used, plan_import, processor_for,
                                         tensors_of)
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.store.entry import (FORMAT_VERSION, WEIGHTS_DIR, converted_dir, entry_files, store_key,
                                 verify_entry, write_manifest)
from offspec.store.packed import build_store, plan_extra, plan_layer
from offspec.util.files import remove_stale_temps, sha256_file, temp_path
from offspec.util.hf import quiet_transformers

from .gguf_tokenizer import gguf_tokenizer

_OLD_SUFFIXES = ("-float32", "-bfloat16", "-float16")


# ----------------------------------------------------------------------------------------------------------
# Building


def _remove_tree(path: Path) -> None:
    """Remove a directory: renamed aside first, so a half-deleted tree never sits at a usable path."""
    if not path.exists():
        return
    trash = temp_path(path, "trash")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _remove_old_format(dest: Path, progress: ProgressFn) -> None:
    for suffix in _OLD_SUFFIXES:
        old = dest.with_name(dest.name + suffix)
        if old.is_dir():
            progress(ProgressEvent("convert", f"removing the old float cache entry {old.name} (replaced by the "
                                              f"low-bit store)"))
            _remove_tree(old)


def _build_store(gguf: Path, tmp: Path, key: str, name: str, progress: ProgressFn) -> dict:
    """Tokenizer, config and the ggml weight store of `gguf` into `tmp`; returns manifest fields."""
    from transformers import GenerationConfig


    with quiet_transformers():
        progress(ProgressEvent("convert", f"reading the tokenizer and config of {name}"))
        tokenizer = gguf_tokenizer(gguf)
        config = gguf_config(gguf, progress, name)
        plan = plan_import(gguf, config)  # ImportUnsupported: the caller converts to float instead
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
    del tokenizer
    processor = processor_for(plan)
    layers = [plan_layer(i, [t.entry() for t in tensors], groups=expert_groups([t.name for t in tensors]))
              for i, tensors in enumerate(plan.layers)]
    extras = {"other": (plan_extra("other", [t.entry() for t in plan.other]),
                        lambda: tensors_of(plan.other, processor))}
    if plan.embed:
        extras["embed"] = (plan_extra("embed", [t.entry() for t in plan.embed]), lambda: tensors_of(plan.embed, processor))
    types = ", ".join(sorted(plan.types))
    for note in plan.notes:
        progress(ProgressEvent("convert", f"{name}: {note}"))
    build_store(tmp / WEIGHTS_DIR, store_key(key), layers, lambda i: tensors_of(plan.layers[i], processor), progress,
                "convert", f"importing {name} ({types}, kept as they are)", extras)
    return {"weights": "ggml", "types": plan.types, "notes": plan.notes, "architecture": plan.architecture}


def gguf_config(gguf: Path, progress: ProgressFn = no_progress, name: str = "") -> Any:
    """transformers' config of `gguf`, completed with what transformers does not read from it (gguf_config.py)."""
    import gguf as gguf_py
    from transformers import AutoConfig

    reader = gguf_py.GGUFReader(str(gguf))
    fields = gguf_fields(reader)
    if fields.get("general.architecture") == "gpt-oss":  # transformers' reader fails on its rope keys
        return gpt_oss_config(fields)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    freqs = next((np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    fields["offspec.rope_factors"] = any(t.name.startswith("rope_factors_") for t in reader.tensors)
    stacked = next((t for t in reader.tensors if t.name.endswith(".ffn_gate_exps.weight")), None)
    if fields.get("general.architecture") == "llama" and stacked is not None:  # Mixtral, as llama.cpp writes it
        config = mixtral_config(config, fields, int(stacked.shape[1]))
    changed = complete_config(config, fields, freqs)
    if changed:
        progress(ProgressEvent("convert", f"{name or gguf.name}: from the GGUF's metadata, as llama.cpp reads it: "
                                          f"{', '.join(changed)}"))
    return config


def _build_float(gguf: Path, tmp: Path, name: str, reason: str, progress: ProgressFn) -> dict:
    """The fallback: transformers de-quantizes the GGUF; saved as float32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    progress(ProgressEvent("convert", f"{name} cannot be kept in its own blocks ({reason}): converting it to float32"))
    with quiet_transformers():
        config = gguf_config(gguf, progress, name)
        check_every_tensor_used(gguf, config)
        tokenizer = gguf_tokenizer(gguf)
        tokenizer.save_pretrained(tmp)
        del tokenizer
        progress(ProgressEvent("convert", f"de-quantizing {name} to float32"))
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     config=config,
                                                     quantization_config=GgufConfig(dequantize=True))
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        progress(ProgressEvent("convert", f"writing {name} as safetensors"))
        model.save_pretrained(tmp)
    del model
    gc.collect()
    return {"weights": "float32", "notes": [f"float32: {reason}"]}


def _finish(tmp: Path, fields: dict, source: str, progress: ProgressFn, name: str) -> None:
    import transformers

    files = []
    names = entry_files(tmp)
    for i, rel in enumerate(names):
        progress(ProgressEvent("convert", f"checksumming {name}", i, len(names)))
        path = tmp / rel
        st = path.stat()
        files.append({"name": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)})
    manifest = {"format": FORMAT_VERSION, "source": source, "created": time.time(),
                "transformers": transformers.__version__, **fields, "files": files}
    write_manifest(tmp, manifest)  # last: its presence means complete


def ensure_converted(gguf: Path, *, key: str, source: str, name: Optional[str] = None,
                     progress: ProgressFn = no_progress, root: Optional[Path] = None) -> Path:
    """Return the converted entry of `gguf`, (re)building it unless it is complete and undamaged.

    `key` names the cache entry (see module doc); `source` is recorded in the manifest; `name` is the display
    name used in progress messages; `root` overrides `cache_dir()`.
    """
    dest = converted_dir(key, root)
    name = name or Path(gguf).name
    _remove_old_format(dest, progress)
    problem = verify_entry(dest, message=f"verifying {name}") if dest.exists() else "missing"
    if problem is None:
        return dest
    gguf = Path(gguf)
    if not gguf.is_file():
        raise OffspecError(f"GGUF file {gguf} not found")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OffspecError(f"cannot create the cache dir {dest.parent}: {exc.strerror or exc}; set "
                           f"OFFSPEC_CACHE_DIR to a writable place") from exc
    remove_stale_temps(dest.parent)
    if problem != "missing":
        progress(ProgressEvent("convert", f"the converted cache entry of {name} is unusable ({problem}); rebuilding"))
    _remove_tree(dest)  # partial or damaged: never used
    tmp = temp_path(dest)
    progress(ProgressEvent("convert", f"converting {name} (one time)"))
    try:
        tmp.mkdir()
        try:
            fields = _build_store(gguf, tmp, key, name, progress)
        except ImportUnsupported as exc:
            shutil.rmtree(tmp)
            tmp.mkdir()
            fields = _build_float(gguf, tmp, name, str(exc), progress)
        _finish(tmp, fields, source, progress, name)
        try:
            os.rename(tmp, dest)
        except OSError:
            if verify_entry(dest) is not None:  # not a concurrent conversion that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OffspecError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except MemoryError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OffspecError(f"out of memory while converting {name}; close other programs and try again") from exc
    except BaseException as exc:  # Ctrl-C included: never leave a multi-GB temp behind
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        raise OffspecError(f"cannot convert {gguf}: {failure_reason(exc)}") from exc
    progress(ProgressEvent("convert", f"converted {name}", finished=True))
    return dest


def failure_reason(exc: BaseException) -> str:
    """One line for a failed conversion; a truncated or damaged GGUF says so."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror or text}; free disk space or choose another cache dir (OFFSPEC_CACHE_DIR)"
    damaged = ("reshape", "buffer", "unpack requires", "unpack", "out of bounds", "truncat", "index", "offset", "mmap length")
    if isinstance(exc, (ValueError, IndexError, KeyError, EOFError)) and any(w in text.lower() for w in damaged):
        return (f"the file looks truncated or damaged ({text}); download it again, or check it against its "
                f"published checksum")
    return text
