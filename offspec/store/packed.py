"""Packed per-layer files: one file per decoder layer, its tensors in ONE contiguous payload, and a manifest.

A set lives in one directory per (model, dtype, format):

    layer-0000.bin ...   a 4 KiB header (magic, set id, layer, payload size, crc32) then the payload, padded to 4 KiB
    other.bin, embed.bin optional extras in the same file format: a complete weight store (a converted GGUF, a
                         quantized model) keeps its LM head and final norm in other.bin (resident) and its token
                         table in embed.bin (memory-mapped: only the rows a pass asks for are read)
    manifest.json        written last: the key (source fingerprint, dtype, format), per layer (and extra) its file,
                         size, crc32 and tensors (name, dtype, shape, byte offset in the payload, and for low-bit
                         weights their ggml type and column count: see offspec/formats); a layer whose parts are
                         read apart (a mixture of experts: its dense part, then each expert) also its *ranges*,
                         each 4 KiB-aligned in the payload with its own crc32 (`LayerSpec.ranges`)

Every file is written to a temp name and renamed; the set is built in a temp directory renamed into place.
A missing manifest, a key that does not match, a missing or short file or a wrong header makes the set
invalid (`StoreInvalid`): `ensure_store` rebuilds it. Payload checksums are checked when a file is read
(see streamer.py / model.py); a mismatch is a one-line OffspecError and the set is marked for a rebuild.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn
from offspec.util.files import atomic_write, remove_stale_temps, temp_path

FORMAT = 2  # 2: ggml block tensors and extras (a format-1 set is rebuilt)
MAGIC = b"OFFSPECL"
HEADER = 4096  # header bytes; also the file alignment (O_DIRECT reads need block-aligned offsets and sizes)
TENSOR_ALIGN = 256  # byte alignment of each tensor inside a payload
MANIFEST = "manifest.json"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.uint8, torch.int8)}


class StoreInvalid(Exception):
    """A packed set that is missing, partial, stale or corrupt (the message says which)."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorSpec:
    name: str  # relative to the decoder layer, e.g. "self_attn.q_proj.weight" or "mlp.up_proj.qweight"
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset in the layer payload
    nbytes: int
    ggml: int = -1  # ggml type id of a low-bit weight stored as (rows, row_bytes) uint8 blocks; -1: a plain tensor
    cols: int = 0  # the logical column count (input features) of a low-bit weight


@dataclass(frozen=True)
class LayerSpec:
    index: int
    file: str
    nbytes: int  # payload bytes (what is streamed per pass)
    tensors: tuple[TensorSpec, ...]
    crc32: int = 0  # of the payload
    # parts of the payload read apart, (offset, nbytes, crc32) each, 4 KiB-aligned: the dense part first (from 0),
    # then one per group the layout was planned with (a mixture's experts); () for a layer read whole
    ranges: tuple[tuple[int, int, int], ...] = ()

    @property
    def file_bytes(self) -> int:
        return HEADER + _round_up(self.nbytes, HEADER)

    def tensors_in(self, index: int) -> tuple[TensorSpec, ...]:
        """The tensors of range `index` (`ranges`)."""
        start, nbytes, _ = self.ranges[index]
        return tuple(t for t in self.tensors if start <= t.offset < start + nbytes)

    def dense(self) -> "LayerSpec":
        """The spec of range 0 alone (the layer's dense part), as a payload of its own."""
        start, nbytes, crc = self.ranges[0]
        return LayerSpec(self.index, self.file, nbytes, self.tensors_in(0), crc)


@dataclass(frozen=True)
class PackedSet:
    directory: Path
    set_id: str
    key: dict
    layers: tuple[LayerSpec, ...]
    extras: dict[str, LayerSpec] = field(default_factory=dict)  # "other", "embed": see the module doc

    def path(self, index: int) -> Path:
        return self.directory / self.layers[index].file

    def extra_path(self, name: str) -> Path:
        return self.directory / self.extras[name].file

    def all_specs(self) -> list[LayerSpec]:
        return list(self.layers) + list(self.extras.values())


def layer_file(index: int) -> str:
    """The file name of decoder layer `index` in a packed set."""
    return f"layer-{index:04d}.bin"


def ssd_files(directory: Path, tiers: Iterable[str]) -> list[Path]:
    """The packed files of the layers a placement reads from SSD (tiers: per layer, "device"/"ram"/"ssd")."""
    return [Path(directory) / layer_file(i) for i, tier in enumerate(tiers) if tier == "ssd"]


EXTRA_FILES = {"other": "other.bin", "embed": "embed.bin"}
EXTRA_INDEX = {"other": -1, "embed": -2}


def plan_layer(index: int, entries: Iterable[tuple], file: Optional[str] = None,
               groups: Iterable[Iterable[str]] = ()) -> LayerSpec:
    """Lay out one layer's tensors in a payload; crc32 is filled in when written. Entries are (name, dtype,
    shape) or, for low-bit weights, (name, torch.uint8, (rows, row_bytes), ggml type id, cols). `groups`: lists of
    tensor names each read apart (a mixture's experts: each expert's gate, up and down), laid out after the other
    tensors, each group together from a 4 KiB boundary, in the order given (`LayerSpec.ranges`)."""
    groups = [list(g) for g in groups]
    grouped = {name for g in groups for name in g}
    entries = list(entries)
    by_name = {e[0]: e for e in entries}
    order = [[e for e in entries if e[0] not in grouped]] + [[by_name[name] for name in g] for g in groups]
    offset, tensors, ranges = 0, [], []
    for chosen in order:
        if groups:
            offset = _round_up(offset, HEADER)
            ranges.append(offset)
        for name, dtype, shape, *lowbit in chosen:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            dtype_name = str(dtype).removeprefix("torch.")
            ggml, cols = (int(lowbit[0]), int(lowbit[1])) if lowbit else (-1, 0)
            tensors.append(TensorSpec(name, dtype_name, tuple(int(s) for s in shape), offset, nbytes, ggml, cols))
            offset = _round_up(offset + nbytes, TENSOR_ALIGN)
    nbytes = max(offset, TENSOR_ALIGN)
    if groups:  # each range to the next one's start (the last: to the payload's end, 4 KiB-rounded)
        nbytes = _round_up(nbytes, HEADER)
        ends = ranges[1:] + [nbytes]
        spans = tuple((start, end - start, 0) for start, end in zip(ranges, ends))
        return LayerSpec(index=index, file=file or layer_file(index), nbytes=nbytes, tensors=tuple(tensors),
                         ranges=spans)
    return LayerSpec(index=index, file=file or layer_file(index), nbytes=nbytes, tensors=tuple(tensors))


def plan_extra(name: str, entries: Iterable[tuple]) -> LayerSpec:
    """The layout of the extra payload `name` ("other" or "embed")."""
    return plan_layer(EXTRA_INDEX[name], entries, EXTRA_FILES[name])


def tensor_views(payload: torch.Tensor, spec: LayerSpec) -> dict[str, torch.Tensor]:
    """Typed views into a (>= spec.nbytes,) uint8 payload buffer, by tensor name. No copies."""
    return {t.name: payload[t.offset : t.offset + t.nbytes].view(dtype_of(t.dtype)).view(t.shape) for t in spec.tensors}


def payload_crc(payload: torch.Tensor) -> int:
    return zlib.crc32(memoryview(payload.numpy())) & 0xFFFFFFFF  # zlib releases the GIL on big buffers


def _header(set_id: str, spec: LayerSpec, crc: int) -> bytes:
    body = json.dumps({"format": FORMAT, "set": set_id, "layer": spec.index, "nbytes": spec.nbytes, "crc32": crc})
    raw = MAGIC + body.encode()
    return raw + b"\0" * (HEADER - len(raw))


def check_header(raw: bytes, set_id: str, spec: LayerSpec) -> Optional[str]:
    """None when a file header matches the manifest, else what is wrong."""
    if raw[: len(MAGIC)] != MAGIC:
        return "bad magic bytes"
    try:
        head = json.loads(raw[len(MAGIC) :].rstrip(b"\0").decode())
    except (ValueError, UnicodeDecodeError):
        return "unreadable header"
    if head.get("set") != set_id or head.get("layer") != spec.index or head.get("nbytes") != spec.nbytes:
        return "header does not match the manifest"
    return None


def write_layer(directory: Path, set_id: str, spec: LayerSpec,
                tensors: Iterable[tuple[str, torch.Tensor]]) -> LayerSpec:
    """Pack (name, tensor) pairs (any order, produced one at a time) into the layer's file at their offsets;
    returns the spec with its crc32. Holds one tensor at a time, never the whole layer."""
    expected = {t.name: t for t in spec.tensors}
    crc = 0
    crcs: list[int] = []  # per range (spec.ranges)

    def write(f) -> None:
        nonlocal crc
        crcs.clear()
        written = set()
        f.truncate(spec.file_bytes)  # zeros: header placeholder, alignment gaps and padding
        for name, value in tensors:
            t = expected[name]
            value = value.detach().to("cpu").contiguous()
            if str(value.dtype).removeprefix("torch.") != t.dtype or tuple(value.shape) != t.shape:
                raise ValueError(f"tensor {name}: {value.dtype} {tuple(value.shape)} does not match "
                                 f"{t.dtype} {t.shape}")
            f.seek(HEADER + t.offset)
            f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
            written.add(name)
        if written != set(expected):
            raise ValueError(f"layer {spec.index}: tensors {sorted(set(expected) - written)} were not produced")
        f.flush()
        done = 0
        f.seek(HEADER)
        starts = {start: i for i, (start, _, _) in enumerate(spec.ranges)}
        part_crc = 0
        while done < spec.nbytes:  # checksum the payload as written (read back in chunks from the page cache)
            end = min(done + 8 * 2**20, spec.nbytes)
            end = min([s for s in starts if done < s < end] + [end])  # a chunk never straddles a range's start
            chunk = f.read(end - done)
            crc = zlib.crc32(chunk, crc)
            part_crc = zlib.crc32(chunk, 0 if done in starts else part_crc)
            done += len(chunk)
            if done in starts or done == spec.nbytes:
                crcs.append(part_crc & 0xFFFFFFFF)
        f.seek(0)
        f.write(_header(set_id, spec, crc & 0xFFFFFFFF))

    # no fsync per layer (gigabytes): the set's manifest, written last, is what says it is complete
    atomic_write(directory / spec.file, write, fsync=False)
    ranges = tuple((start, nbytes, c) for (start, nbytes, _), c in zip(spec.ranges, crcs)) if spec.ranges else ()
    return LayerSpec(spec.index, spec.file, spec.nbytes, spec.tensors, crc & 0xFFFFFFFF, ranges)


def _spec_dict(s: LayerSpec) -> dict:
    out = {"index": s.index, "file": s.file, "nbytes": s.nbytes, "crc32": s.crc32,
           "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes, t.ggml, t.cols] for t in s.tensors]}
    if s.ranges:
        out["ranges"] = [list(r) for r in s.ranges]
    return out


def _spec_of(d: dict) -> LayerSpec:
    return LayerSpec(int(d["index"]), str(d["file"]), int(d["nbytes"]),
                     tuple(TensorSpec(n, dt, tuple(sh), int(o), int(b), int(g), int(c))
                           for n, dt, sh, o, b, g, c in d["tensors"]), int(d["crc32"]),
                     tuple((int(o), int(b), int(c)) for o, b, c in d.get("ranges", ())))


def _manifest_dict(packed: PackedSet) -> dict:
    return {"format": FORMAT, "set_id": packed.set_id, "key": packed.key,
            "layers": [_spec_dict(s) for s in packed.layers],
            "extras": {name: _spec_dict(s) for name, s in packed.extras.items()}}


def open_store(directory: Path, key: dict) -> PackedSet:
    """The valid packed set in `directory` for `key`, or StoreInvalid. Checks sizes and headers, not checksums."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise StoreInvalid("no manifest (missing or partial set)")
    try:
        data = json.loads(manifest.read_text())
        if data.get("format") != FORMAT:
            raise StoreInvalid(f"made by another version of offspec (format {data.get('format')}, now {FORMAT})")
        layers = tuple(_spec_of(l) for l in data["layers"])
        extras = {str(name): _spec_of(e) for name, e in data.get("extras", {}).items()}
        set_id = str(data["set_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreInvalid(f"unreadable manifest ({exc})") from None
    if data.get("key") != key:
        raise StoreInvalid("made for another model, dtype or format")
    if [s.index for s in layers] != list(range(len(layers))):
        raise StoreInvalid("manifest layers out of order")
    for spec in list(layers) + list(extras.values()):
        path = directory / spec.file
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(HEADER)
        except OSError:
            raise StoreInvalid(f"{spec.file} missing") from None
        if size != spec.file_bytes:
            raise StoreInvalid(f"{spec.file} is {size} bytes, expected {spec.file_bytes} (truncated?)")
        problem = check_header(head, set_id, spec)
        if problem:
            raise StoreInvalid(f"{spec.file}: {problem}")
    return PackedSet(directory, set_id, key, layers, extras)


def mark_corrupt(directory: Path) -> None:
    """Remove the manifest so the next start rebuilds the set (used when a checksum fails mid-run)."""
    try:
        (directory / MANIFEST).unlink()
    except OSError:
        pass


def build_store(directory: Path, key: dict, plans: list[LayerSpec], make_layer: Callable[[int], Iterable],
                progress: ProgressFn, step: str, message: str,
                extras: Optional[dict[str, tuple[LayerSpec, Callable[[], Iterable]]]] = None) -> PackedSet:
    """Write a new set: every layer file and extra, then the manifest, in a temp directory renamed to `directory`.
    `extras` maps "other"/"embed" to (layout, a maker of its (name, tensor) pairs)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(directory.parent)
    tmp = temp_path(directory)
    set_id = uuid.uuid4().hex
    extras = extras or {}
    total = len(plans) + len(extras)
    try:
        tmp.mkdir()
        specs = []
        for i, plan in enumerate(plans):
            progress(ProgressEvent(step, message, i, total))
            specs.append(write_layer(tmp, set_id, plan, make_layer(i)))
        written = {}
        for j, (name, (plan, make)) in enumerate(extras.items()):
            progress(ProgressEvent(step, message, len(plans) + j, total))
            written[name] = write_layer(tmp, set_id, plan, make())
        packed = PackedSet(directory, set_id, key, tuple(specs), written)
        # the manifest last: its presence means complete
        atomic_write(tmp / MANIFEST, json.dumps(_manifest_dict(packed)), fsync=False)
        if directory.exists():
            try:  # another process may have finished the same set meanwhile: keep theirs
                theirs = open_store(directory, key)
                shutil.rmtree(tmp, ignore_errors=True)
                progress(ProgressEvent(step, message, total, total, finished=True))
                return theirs
            except StoreInvalid:
                shutil.rmtree(directory)
        os.rename(tmp, directory)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OffspecError(f"cannot write packed layers to {directory.parent}: {exc.strerror or exc}; free disk "
                           f"space or choose another place with --offload-dir") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(ProgressEvent(step, message, total, total, finished=True))
    return packed


def ensure_store(directory: Path, key: dict, plans: list[LayerSpec], make_layer: Callable[[int], Iterable],
                 progress: ProgressFn, step: str, message: str,
                 extras: Optional[dict[str, tuple[LayerSpec, Callable[[], Iterable]]]] = None) -> PackedSet:
    """Open the set in `directory`, (re)building it when it is missing, partial, stale or corrupt."""
    extras = extras or {}
    try:
        packed = open_store(directory, key)
        same_layers = [(s.nbytes, s.tensors) for s in packed.layers] == [(p.nbytes, p.tensors) for p in plans]
        same_extras = {n: (s.nbytes, s.tensors) for n, s in packed.extras.items()} == \
            {n: (p.nbytes, p.tensors) for n, (p, _) in extras.items()}
        if same_layers and same_extras:
            return packed
        reason = "its layout differs from this model's"
    except StoreInvalid as exc:
        reason = str(exc)
    if directory.exists():
        message = f"{message} (the packed set in {directory} is invalid: {reason}; rebuilding)"
    return build_store(directory, key, plans, make_layer, progress, step, message, extras)
