"""`--draft self`: a draft made from the target itself, its decoder-block weights requantized to 2-3 bits.

`self_copy(target_gguf, "Q3_K")` writes (once per target and type) a GGUF of the target's architecture and
tokenizer: every metadata key copied as it is (general.name marked as the copy, general.file_type the new type),
each decoder-block matrix (`blk.N.*.weight`, 2-D, its rows a multiple of 256 values) requantized with offspec's
own K-quant encoder (offspec/formats/kquant.py) unless its own type already takes that few bits per weight or
fewer, and everything else (norms, biases, the token table, the LM head) copied byte for byte. It is an ordinary
GGUF with the target's tensor names, so the draft path loads it like any draft with the target's tokenizer, and a
later step can take single layers from it.

The copy lives in `<cache_dir>/self/<stem>-<path hash>-<target hash>-<type>-v<FORMAT>.gguf`: the target's
resolved path, size and mtime, the type and the format version (bumped when the encoder's output changes) name
it, so a changed target or quantizer gives a new copy (the older copies of the same target path are removed
then). It is written to a temp beside it, fsync'd and renamed; a `.built` marker (its size and mtime) written
after says it is complete. Ctrl-C or an error removes the temp and leaves the cache as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from offspec.errors import OffspecError
from offspec.formats import kquant
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.files import atomic_write, remove_stale_temps, temp_path
from offspec.util.paths import cache_dir

SELF = "self"
DEFAULT_TYPE = "Q3_K"
FORMAT_VERSION = 1  # bump when the copy's bytes change for the same target (encoder, tensor choice, metadata)
STEP = "self_draft"
_BLOCK_WEIGHT = re.compile(r"^blk\.\d+\..+\.weight$")
_KEEP_FLOAT = ("ffn_gate_inp",)  # MoE routers: small, and kept float as llama.cpp keeps them
_FILE_TYPE = {"Q2_K": 10, "Q3_K": 12}  # general.file_type: llama.cpp's MOSTLY_Q2_K, MOSTLY_Q3_K_M


def self_draft_type(spec: Optional[str]) -> Optional[str]:
    """The type a draft spec asks for when it is `self` ("self" -> "Q3_K", "self:q2_k" -> "Q2_K"), else None."""
    if spec is None:
        return None
    head, _, tail = spec.strip().partition(":")
    if head.lower() != SELF:
        return None
    type_name = tail.strip().upper() or DEFAULT_TYPE
    if type_name not in kquant.TYPES:
        raise OffspecError(f"--draft {spec.strip()}: a self draft is requantized to one of "
                           f"{', '.join(sorted(kquant.TYPES))}; use --draft self or --draft self:Q2_K")
    return type_name


def copy_path(target_gguf: Path, type_name: str, root: Optional[Path] = None) -> Path:
    """Where the `type_name` copy of `target_gguf` is kept (see the module doc)."""
    resolved = Path(target_gguf).resolve()
    st = resolved.stat()
    slug = re.sub(r"[^a-z0-9._-]+", "-", resolved.stem.lower()).strip("-.")[:60] or "model"
    where = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    ident = hashlib.sha256(f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:8]
    base = (root if root is not None else cache_dir()) / "self"
    return base / f"{slug}-{where}-{ident}-{type_name.lower()}-v{FORMAT_VERSION}.gguf"


def marker_path(copy: Path) -> Path:
    """The `.built` marker beside `copy` (see the module doc)."""
    return copy.with_name(copy.name + ".built")


def is_built(copy: Path) -> bool:
    """Whether `copy` is complete: its marker names its size and mtime."""
    try:
        st = copy.stat()
        marker = json.loads(marker_path(copy).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


@dataclass(frozen=True)
class _Plan:
    """One tensor of the copy: its name, the type it is written in and its bytes."""

    name: str
    type_id: int  # ggml type of the copy's tensor
    shape: tuple[int, ...]  # numpy shape of the bytes written: (rows, row_bytes) uint8 when requantized
    dtype: np.dtype
    nbytes: int
    requantize: bool


def _plan(tensor, type_name: str) -> _Plan:
    """What the copy does with `tensor` (a gguf ReaderTensor): requantize it to `type_name`, or copy it."""
    import gguf

    src = gguf.GGMLQuantizationType(int(tensor.tensor_type))
    block, nbytes = gguf.GGML_QUANT_SIZES[src]
    dst = gguf.GGMLQuantizationType[type_name]
    dst_block, dst_bytes = gguf.GGML_QUANT_SIZES[dst]
    ne = [int(n) for n in tensor.shape]  # ggml order: ne[0] = cols (inputs)
    requantize = (_BLOCK_WEIGHT.match(tensor.name) is not None and len(ne) == 2 and ne[0] % dst_block == 0
                  and not any(k in tensor.name for k in _KEEP_FLOAT) and 8 * nbytes / block > 8 * dst_bytes / dst_block)
    if not requantize:
        data = tensor.data
        return _Plan(tensor.name, int(src), tuple(data.shape), data.dtype, int(data.nbytes), False)
    cols, rows = ne
    row_bytes = cols // dst_block * dst_bytes
    return _Plan(tensor.name, int(dst), (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, True)


def _requantized(tensor, type_name: str) -> np.ndarray:
    """(rows, row_bytes) uint8: `tensor`'s values as `type_name` blocks."""
    import gguf

    try:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)  # (rows, cols) float32
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise OffspecError(f"--draft self: cannot decode {tensor.name} ({tensor.tensor_type.name}) of the target: "
                           f"{exc or type(exc).__name__}; use another draft (--draft small.gguf)") from exc
    try:
        return kquant.quantize_k(np.asarray(values, dtype=np.float32), type_name)  # (rows, row_bytes) uint8
    except ValueError as exc:
        raise OffspecError(f"--draft self: cannot requantize {tensor.name} of the target: {exc}") from exc


def _copy_metadata(reader, writer, type_name: str) -> None:
    """Every key of `reader` onto `writer` with its types (as gguf-py's gguf_new_metadata.py copies them), the
    name and file type changed; the architecture the writer adds itself, the GGUF.* entries are the header's."""
    import gguf

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))  # the tensor data is laid out by it too
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        if sub_type == gguf.GGUFValueType.ARRAY:
            raise OffspecError(f"--draft self: the target's metadata {field.name} is an array of arrays, which the "
                               f"copy cannot write; use another draft (--draft small.gguf)")
        value = field.contents()
        if field.name == gguf.Keys.General.NAME:
            value = f"{value} (offspec self draft, {type_name})"
        elif field.name == gguf.Keys.General.FILE_TYPE:
            value = _FILE_TYPE[type_name]
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)


def _remove_older(copy: Path) -> None:
    """Remove the other copies of the same target path (a changed target, an older format or another type keeps
    its own name: only the same type's older copies go)."""
    parts = copy.name.split("-")  # <stem parts>, <path hash>, <target hash>, <type>, v<FORMAT>.gguf
    prefix = "-".join(parts[:-3])  # <stem>-<path hash>
    for other in copy.parent.glob(f"{prefix}-*-{parts[-2]}-v*.gguf"):
        if other != copy and other.name.count("-") == copy.name.count("-"):
            marker_path(other).unlink(missing_ok=True)
            other.unlink(missing_ok=True)


def _write(reader, tmp: Path, type_name: str, plans: list[_Plan], progress: ProgressFn, message: str) -> None:
    import gguf

    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _copy_metadata(reader, writer, type_name)
        for p in plans:
            writer.add_tensor_info(p.name, p.shape, p.dtype, p.nbytes, raw_dtype=gguf.GGMLQuantizationType(p.type_id))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # the encoder is numpy over whole tensors (it lets go of the GIL): one tensor per core at a time, written
        # in order, at most one more than the workers held at once
        workers = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offspec-self-draft")
        try:
            pending: deque = deque()
            work = iter(zip(reader.tensors, plans))
            for i in range(len(plans)):
                while len(pending) <= workers and (job := next(work, None)) is not None:
                    tensor, p = job
                    pending.append(pool.submit(_requantized, tensor, type_name) if p.requantize else tensor.data)
                progress(ProgressEvent(STEP, message, i, len(plans)))
                head = pending.popleft()
                writer.write_tensor_data(head.result() if isinstance(head, Future) else head)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C: the tensors under way are dropped
        out = writer.fout[0]
        out.flush()
        os.fsync(out.fileno())
    finally:
        writer.close()


def self_copy(target_gguf: Path, type_name: str = DEFAULT_TYPE, progress: ProgressFn = no_progress,
              root: Optional[Path] = None) -> Path:
    """The `type_name` copy of `target_gguf` (built once, then taken from the cache; see the module doc).
    `root`: the cache dir (default `cache_dir()`)."""
    import gguf

    if type_name not in kquant.TYPES:
        raise OffspecError(f"a self draft is requantized to one of {', '.join(sorted(kquant.TYPES))}, "
                           f"not {type_name!r}")
    target_gguf = Path(target_gguf).resolve()
    copy = copy_path(target_gguf, type_name, root)
    if is_built(copy):
        line = f"self draft: {type_name} copy of {target_gguf.stem}, {_mb(copy.stat().st_size)}, cached"
        progress(ProgressEvent(STEP, line, 1, 1, finished=True))
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(copy.parent)  # the temps of builds killed outright
    try:
        reader = gguf.GGUFReader(str(target_gguf))
    except (OSError, ValueError) as exc:
        raise OffspecError(f"--draft self: cannot read the target {target_gguf}: {exc}") from exc
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise OffspecError(f"--draft self: {target_gguf.name} is a big-endian GGUF; use another draft")
    plans = [_plan(t, type_name) for t in reader.tensors]
    message = f"self draft: requantizing {target_gguf.stem} to {type_name}"
    tmp = temp_path(copy)
    try:
        _write(reader, tmp, type_name, plans, progress, message)
        os.replace(tmp, copy)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OffspecError(f"--draft self: cannot write the copy in {copy.parent}: {exc.strerror or exc}; free "
                           f"disk space or set OFFSPEC_CACHE_DIR") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    st = copy.stat()
    atomic_write(marker_path(copy), json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns}), fsync=False)
    _remove_older(copy)
    kept = sum(1 for p in plans if not p.requantize and _BLOCK_WEIGHT.match(p.name) and len(p.shape) == 2)
    also = f" ({kept} block weights kept at their own type)" if kept else ""
    # the progress renderer adds the time it took
    line = f"self draft: {type_name} copy of {target_gguf.stem}, {_mb(st.st_size)}, built{also}"
    progress(ProgressEvent(STEP, line, len(plans), len(plans), finished=True))
    return copy


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"
