"""Materializing a placed model from its packed store: the resident parts (the `other` payload, or a float
checkpoint's non-layer tensors), the token table memory-mapped from `embed.bin`, resident layers bound to
buffers, RAM-tier layers read into (pinned) host buffers, and a `LayerStreamer` with forward hooks for the rest.
Used by offspec.offload.model (step 4 of its load).

On a CPU the resident payloads (`other`, resident layers: the whole draft) are memory-mapped from their files
rather than copied into anonymous memory: the kernels read the same bytes, but the pages are the file's, so
under memory pressure (a memory cgroup, a busy machine) the kernel drops the coldest of them and reads them
again instead of killing the process. Only the KV caches, activations, streaming slots and the Python runtime
must stay in anonymous memory, and the weights of resident layers and of an untied LM head, whose rows
are interleaved for the CPU kernels in place (`_interleave_resident`): their pages become the process's own.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.experts import PROJECTIONS, QExperts, QRouter
from offspec.formats.modules import QEmbedding, QLinear
from offspec.progress import ProgressEvent, ProgressFn
from offspec.store.packed import HEADER, LayerSpec, PackedSet, dtype_of, mark_corrupt, payload_crc

from .binding import LayerBinding, as_compute, attach_streaming, skinny_cpu_linears
from .checkpoint import Checkpoint
from .config import OffloadConfig
from .diskio import FileReader, aligned_empty
from .experts import ExpertCache, ExpertSlots, ExpertStream
from .hostmem import MADV_RANDOM, advise, trim_heap
from .head import StreamedHead, chunk_crcs
from .placement import Placement
from .ram_experts import RamExpertCache
from .skeleton import Skeleton
from .streamer import LayerSource, LayerStreamer


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attr = name.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attr


class CorruptPart(Exception):
    """A resident part of the store failed its checksum (the caller rebuilds the store, or says it is damaged)."""


def _set(model: nn.Module, name: str, value: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """Bind `value` as `name`'s parameter (converted to the compute `dtype`, see binding.as_compute) or buffer."""
    owner, attr = owner_of(model, name)
    if attr in owner._parameters:
        value = as_compute(value, dtype)
        owner._parameters[attr] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():  # non-persistent buffers (rotary tables) were built on the CPU
        if isinstance(module, QEmbedding):
            continue  # its table stays where it was mapped
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _load_checkpoint_parts(sk: Skeleton, ck: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
    """Embeddings, final norm, LM head (and any other non-layer tensor) from the checkpoint onto the device."""
    model = sk.model
    tie = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                  "tie_word_embeddings", False)
    out_emb = model.get_output_embeddings()
    keys = [k for k in model.state_dict(keep_vars=True) if not k.startswith(sk.prefix)]
    for key in sorted(keys, key=lambda k: k not in ck):  # one tensor at a time; tied ones (absent) last
        owner, attr = owner_of(model, key)
        if key in ck:
            t = ck.read(key)
            t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        elif tie and owner is out_emb and attr == "weight":
            t = model.get_input_embeddings().weight  # tied LM head: the same tensor
        else:
            raise OffspecError(f"cannot offload {ck.name}: its checkpoint has no tensor {key!r}")
        _set(model, key, t)
        del t


def _read_payload(reader: FileReader, path: Path, spec: LayerSpec, into: torch.Tensor) -> torch.Tensor:
    """Read a packed file into `into` ((file_bytes,) host); returns its payload view; CorruptPart on a bad crc."""
    reader.read(path, into, spec.file_bytes)
    payload = into[HEADER : HEADER + spec.nbytes]
    if payload_crc(payload) != spec.crc32:
        raise CorruptPart(f"{path}: checksum mismatch")
    return payload


def _mapped(path: Path, offset: int, nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 host view of `path` from `offset`, memory-mapped copy-on-write: a page never written stays the
    file's (read where touched, and dropped again under memory pressure); the pages of weights interleaved for the
    CPU kernels (`_interleave_resident`) become the process's own, the same bytes in all."""
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,)))


def _map_payload(path: Path, spec: LayerSpec) -> torch.Tensor:
    """(nbytes,) uint8 view of a packed file's payload, mapped (`_mapped`); CorruptPart on a bad crc. The checksum
    is read apart (`_file_crc`), not through the mapping, so that only the pages the model touches are ever mapped:
    a tied token table (a draft's 136 MB) is read one looked-up row at a time. HEADER is a multiple of the page size,
    so the payload is page-aligned as a read buffer's would be."""
    if _file_crc(path, spec) != spec.crc32:
        raise CorruptPart(f"{path}: checksum mismatch")
    return _mapped(path, HEADER, spec.nbytes)


def _file_crc(path: Path, spec: LayerSpec) -> int:
    """crc32 of a packed file's payload (the first `spec.nbytes` of it), read in chunks without keeping its pages
    cached."""
    import os

    crc, done = 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < spec.nbytes:
            chunk = os.pread(fd, min(8 * 2**20, spec.nbytes - done), HEADER + done)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            done += len(chunk)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return crc & 0xFFFFFFFF


def _interleave_resident(layer: nn.Module) -> None:
    """A CPU-resident layer's weights interleaved for the kernels, in place (formats.kernels.interleave:
    a decoding step reads them 1.4-2x faster; the same results). Streamed layers keep their rows as stored, and so
    do experts read as routed."""
    for name, module in layer.named_modules():
        if isinstance(module, QLinear) and not _read_as_routed(layer, name):
            kernels.interleave(module)


def _read_as_routed(layer: nn.Module, name: str) -> bool:
    owner = name.rpartition(".experts.")[0]
    return ".experts." in name and getattr(layer.get_submodule(owner + ".experts"), "stream", None) is not None


def _experts_as_routed(layer: nn.Module, index: int, spec: LayerSpec, path: Path, cache: ExpertSlots,
                       following: Optional[nn.Module], reader: FileReader) -> None:
    """Give `layer`'s QExperts its experts from `cache` (range e + 1 of `spec` holds expert e), read from `path`
    as routed, or held in RAM from now (a RamExpertCache); `following`, the next decoder layer (None for the last),
    whose router predicts what to read ahead."""
    experts = next(m for m in layer.modules() if isinstance(m, QExperts))
    layout = []
    for e, (start, _, _) in enumerate(spec.ranges[1:]):
        by_name = {t.name.rpartition(".experts.")[2]: t for t in spec.tensors_in(e + 1)}
        layout.append(tuple((by_name[f"{e}.{proj}.qweight"].offset - start, by_name[f"{e}.{proj}.qweight"].nbytes)
                            for proj in PROJECTIONS))
    if len(layout) != len(experts):
        raise CorruptPart(f"{path}: {len(layout)} expert ranges for {len(experts)} experts")
    if isinstance(cache, RamExpertCache):
        cache.register(index, _held_experts(reader, path, spec, cache.device))
    else:
        cache.register(index, path, spec.ranges[1:])
    router = next((m for m in following.modules() if isinstance(m, QRouter)), None) if following is not None else None
    experts.read_as_routed(ExpertStream(cache, index, router, index + 1), layout)


def _held_experts(reader: FileReader, path: Path, spec: LayerSpec, device: torch.device) -> list[torch.Tensor]:
    """A layer's experts read once into one host buffer (pinned for a CUDA `device`), each checked against its
    crc32 (CorruptPart on a mismatch); returns per expert its (nbytes,) uint8 view."""
    ranges = spec.ranges[1:]
    first = ranges[0][0]
    span = -(-(spec.nbytes - first) // HEADER) * HEADER  # to the payload's padded end: whole 4 KiB blocks
    buf = aligned_empty(span, pin=device.type == "cuda", device=device)  # (span,) host, the layer's experts
    reader.read(path, buf, span, offset=HEADER + first)
    views = []
    for e, (start, nbytes, crc) in enumerate(ranges):
        view = buf[start - first : start - first + nbytes]
        if payload_crc(view) != crc:
            raise CorruptPart(f"{path}: checksum mismatch (expert {e})")
        views.append(view)
    return views


def _bind_payload(model: nn.Module, spec: LayerSpec, payload: torch.Tensor, dtype: torch.dtype) -> None:
    for name, view in LayerBinding.views(payload, spec).items():
        _set(model, name, view, dtype)


def _load_store_extras(sk: Skeleton, packed: PackedSet, reader: FileReader, device: torch.device,
                       dtype: torch.dtype, config: OffloadConfig, stream_head: bool = False) -> None:
    """The resident `other` payload (checked), and the token table memory-mapped from `embed.bin`; with
    `stream_head` (a CPU), the LM head becomes a StreamedHead reading its rows from `other.bin` in every call."""
    spec = packed.extras["other"]
    crcs = None
    if stream_head:
        crcs = _check_around_head(sk, packed)
        payload = _mapped(packed.extra_path("other"), HEADER, spec.nbytes)  # checked; the head's pages stay unread
    elif device.type == "cpu":
        payload = _map_payload(packed.extra_path("other"), spec)  # (nbytes,) uint8, file-backed pages (see above)
    else:  # (nbytes,) uint8: LM head and final norm stay resident on the device
        payload = _read_payload(reader, packed.extra_path("other"), spec, aligned_empty(spec.file_bytes)).to(device)
    _bind_payload(sk.model, spec, payload, dtype)
    if crcs is not None:
        _swap_head(sk, packed, reader, config, crcs)
    elif (device.type == "cpu" and not sk.tied and config.interleave_head
          and isinstance(sk.model.get_output_embeddings(), QLinear)):
        kernels.interleave(sk.model.get_output_embeddings())  # a resident head of its own: read at every step
    emb = sk.model.get_input_embeddings()
    if "embed" in packed.extras:
        espec = packed.extras["embed"]
        path = packed.extra_path("embed")
        if config.verify != "never" and _file_crc(path, espec) != espec.crc32:
            raise CorruptPart(f"{path}: checksum mismatch")
        table = _mapped(path, HEADER, espec.nbytes)  # host pages, read where asked, without read-ahead
        advise(table, MADV_RANDOM)
        _bind_payload(sk.model, espec, table, dtype)
    if sk.tied:
        sk.model.get_output_embeddings()._buffers["qweight"] = emb.qweight  # the LM head reads the token table


def head_entry(sk: Skeleton) -> Optional[tuple[str, Any]]:
    """(module name, TensorSpec of its ggml rows in the store's `other` payload) of an LM head a CPU may stream:
    a low-bit head of its own (a tied head is the memory-mapped token table, which only costs the rows read).
    None where there is no such head."""
    head = sk.model.get_output_embeddings()
    if not sk.complete_store or sk.tied or "other" not in sk.extras or not isinstance(head, QLinear):
        return None
    name = next(n for n, m in sk.model.named_modules() if m is head)
    spec = next((t for t in sk.extras["other"].tensors if t.name == name + ".qweight"), None)
    return None if spec is None else (name, spec)


def _check_around_head(sk: Skeleton, packed: PackedSet) -> list[int]:
    """Check the `other` payload (CorruptPart on a bad crc), read once without keeping its pages; returns the LM
    head's chunk checksums (as StreamedHead cuts it), taken on the way."""
    import os

    spec, path = packed.extras["other"], packed.extra_path("other")
    _, t = head_entry(sk)
    fd = os.open(path, os.O_RDONLY)
    try:  # the payload's crc: the bytes before the head, the head chunk by chunk, the bytes after it
        seed = zlib.crc32(os.pread(fd, t.offset, HEADER))
        crcs, crc = chunk_crcs(path, HEADER + t.offset, t.nbytes // t.shape[0], t.shape[0], seed)
        end = t.offset + t.nbytes
        crc = zlib.crc32(os.pread(fd, spec.nbytes - end, HEADER + end), crc) & 0xFFFFFFFF
    finally:
        os.close(fd)
    if crc != spec.crc32:
        raise CorruptPart(f"{path}: checksum mismatch")
    return crcs


def _swap_head(sk: Skeleton, packed: PackedSet, reader: FileReader, config: OffloadConfig, crcs: list[int]) -> None:
    """Replace the (bound) LM head by a StreamedHead over its rows in `other.bin`: it keeps the head's bias and
    none of its rows."""
    name, t = head_entry(sk)

    def on_corrupt() -> str:
        mark_corrupt(packed.directory)
        return f"the set in {packed.directory} will be rebuilt on the next start"

    head = sk.model.get_output_embeddings()
    streamed = StreamedHead(head, packed.extra_path("other"), HEADER + t.offset, reader, crcs, config.verify,
                            on_corrupt)
    parent_name, _, child = name.rpartition(".")
    setattr(sk.model.get_submodule(parent_name) if parent_name else sk.model, child, streamed)


def mapped_tensor(packed: PackedSet, name: str) -> Optional[torch.Tensor]:
    """A host view of tensor `name` of the store's resident parts (`other`, `embed`), memory-mapped from its file:
    its pages are read only where touched, and not kept resident. None where the store has no such tensor."""
    for extra, spec in packed.extras.items():
        for t in spec.tensors:
            if t.name == name:
                mapped = _mapped(packed.extra_path(extra), HEADER + t.offset, t.nbytes)
                return mapped.view(dtype_of(t.dtype)).view(t.shape)
    return None


def materialize(sk: Skeleton, ck: Optional[Checkpoint], packed: PackedSet, placement: Placement, device: torch.device,
                 dtype: torch.dtype, config: OffloadConfig, progress: ProgressFn,
                 name: str) -> tuple[Optional[LayerStreamer], Optional[ExpertSlots]]:
    """Load what `placement` keeps resident and set up the rest: returns the layer streamer (None when no layer
    streams) and the expert cache (None unless a mixture's experts are read as routed)."""
    reader = FileReader(config.direct_io)
    if sk.complete_store:
        _load_store_extras(sk, packed, reader, device, dtype, config, placement.head_streamed)
    else:
        _load_checkpoint_parts(sk, ck, device, dtype)
    _move_buffers(sk.model, device)
    cuda = device.type == "cuda"
    # (file_bytes,) host buffer for the resident layers' reads; pageable: nothing stays pinned after loading (issue 12)
    staging = aligned_empty(max(s.file_bytes for s in packed.layers)) if cuda else None
    sources, bindings = [], []
    n = len(sk.layers)
    experts = _expert_cache(placement, config, reader, device, packed)
    for i, (layer, tier) in enumerate(zip(sk.layers, placement.tiers)):
        progress(ProgressEvent("load", f"loading {name}", i, n))
        spec = packed.layers[i]
        if experts is not None and spec.ranges:  # resident: the dense part; the experts as routed
            _experts_as_routed(layer, i, spec, packed.path(i), experts, sk.layers[i + 1] if i + 1 < n else None,
                               reader)
            spec = spec.dense()
        binding = LayerBinding(layer, spec, dtype)
        if tier == "device":
            if cuda:
                payload = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)  # (nbytes,) resident layer
                payload.copy_(_read_payload(reader, packed.path(i), spec, staging))  # blocking: staging is reused
            else:  # host memory is the device: the file's own pages (see above)
                payload = _map_payload(packed.path(i), spec)
            binding.bind(payload)
            if not cuda:
                _interleave_resident(layer)
        elif tier == "ram":
            buf = aligned_empty(spec.file_bytes, pin=cuda, device=device)  # (file_bytes,) host copy, pinned on CUDA
            sources.append(LayerSource(i, spec, ram=_read_payload(reader, packed.path(i), spec, buf)))
            bindings.append(binding)
        else:
            if not any(s.path for s in sources):
                reader.probe(packed.path(i))  # O_DIRECT, or buffered where the file system refuses it
            sources.append(LayerSource(i, spec, path=packed.path(i)))
            bindings.append(binding)
        if device.type == "cpu" and dtype == torch.float32:
            skinny_cpu_linears(layer)  # float layers only: low-bit ones use offspec's kernels
    progress(ProgressEvent("load", f"loading {name}", n, n, finished=True))
    if not sources:
        return None, experts

    streamer = LayerStreamer(device, sources, ring_slots=config.ring_slots, staging_buffers=config.staging_buffers,
                             reader=reader, set_id=packed.set_id, verify=config.verify,
                             on_corrupt=lambda: _rebuild(packed))
    for src, binding in zip(sources, bindings):
        attach_streaming(sk.layers[src.index], src.index, streamer, binding)
    if device.type == "cpu" and config.device_mem is not None:
        # a CPU budget holds the whole process: after a pass's last streamed layer, the heap's freed middle (that
        # pass's activations) goes back to the OS, so that passes of other sizes do not pile up fragments
        sk.layers[sources[-1].index].register_forward_hook(lambda *_: trim_heap(collect=False), always_call=True)
    return streamer, experts


def _expert_cache(placement: Placement, config: OffloadConfig, reader: FileReader, device: torch.device,
                  packed: PackedSet) -> Optional[ExpertSlots]:
    """The expert cache `placement` asks for: on the device, filled from RAM where it holds the experts, else from
    SSD; None where the experts are not read as routed."""
    if not placement.experts_cached:
        return None
    prefetch = config.expert_prefetch == "on"
    if placement.expert_host_bytes:
        return RamExpertCache(placement.expert_cache_bytes, placement.sizes.expert_unit, device,
                              policy=config.expert_policy, prefetch=prefetch)
    return ExpertCache(placement.expert_cache_bytes, placement.sizes.expert_unit, reader, policy=config.expert_policy,
                       verify=config.verify, on_corrupt=lambda: _rebuild(packed), prefetch=prefetch)


def _rebuild(packed: PackedSet) -> str:
    """What a checksum failure while running says: the set is rebuilt on the next start."""
    mark_corrupt(packed.directory)
    return f"the set in {packed.directory} will be rebuilt on the next start"
