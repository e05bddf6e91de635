"""The doctor's checks of streaming itself: copy/compute overlap at the model's layer size, streamed == resident."""

from __future__ import annotations

from typing import Optional

import torch

from offspec.errors import OffspecError
from offspec.models.sources import resolve_model
from offspec.offload.skeleton import from_checkpoint
from offspec.store.entry import store_key
from offspec.store.packed import StoreInvalid, open_store
from offspec.util.device import free_memory
from offspec.util.sizes import format_size

from .checks import FAIL, PASS, Check, needs_cuda
from .logits import compare_in_temp
from .overlap import measure_overlap

MIN_OVERLAP = 0.7  # share of the shorter of copy and compute hidden behind the other
STREAM_GOAL = 0.9  # the streamer's own copies should reach 90% of a raw pinned copy
# a Llama-3-70B decoder layer in 16-bit: q, o 8192x8192; k, v 8192x1024; gate, up, down 8192x28672; two norms
SEVENTY_B_LAYER = 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)


def layer_size(target: Optional[str], dtype: torch.dtype, progress) -> tuple[int, str]:
    """(bytes, what) of the largest decoder layer of `target` (None: the built-in target) in `dtype`, as the
    streamer moves it; a 70B-shaped layer where the model cannot be resolved without work the user did not ask for."""
    try:
        resolved = resolve_model(target, "target", progress=progress)
        if resolved.store is not None:  # a converted GGUF: its layers stream as the stored blocks
            plans = open_store(resolved.store, store_key(resolved.path.name)).layers
        else:
            plans = from_checkpoint(resolved.path, dtype, "sdpa", "none", torch.device("cpu")).plans
    except (OffspecError, StoreInvalid) as exc:
        if target is not None:
            raise OffspecError(f"cannot read the layers of {target}: {exc}") from None
        elem = torch.empty((), dtype=dtype).element_size()
        return SEVENTY_B_LAYER * elem // 2, f"a 70B-shaped layer (the default target is not set up: {exc})"
    return max(p.nbytes for p in plans), f"the layers of {resolved.name}"


def fitting_size(device: torch.device, layer_bytes: int, ring_slots: int = 2) -> int:
    """`layer_bytes`, or less where two slots of it (and the matmul operands) would take more than half the free
    device memory or one pinned copy more than a quarter of the available RAM; a multiple of 4 KiB."""
    import psutil


    room = psutil.virtual_memory().available // 4
    if device.type == "cuda":
        free, _ = free_memory(device)
        room = min(room, (free // 2 - 256 * 2**20) // ring_slots)
    return max(4096, min(layer_bytes, room) // 4096 * 4096)


def overlap_check(device: torch.device, dtype: torch.dtype, layer_bytes: int, what: str,
                  pinned_bandwidth: Optional[float], quick: bool) -> Check:
    name = "copy/compute overlap"
    if device.type != "cuda":
        return needs_cuda(name, device)
    size = fitting_size(device, layer_bytes)
    scaled = "" if size == layer_bytes else f", scaled down from {format_size(layer_bytes)} to fit"
    m = measure_overlap(device, dtype, size, layers=4, passes=2 if quick else 3)
    figures = dict(m, layer_source=what, model_layer_bytes=layer_bytes, raw_pinned=pinned_bandwidth)
    text = (f"{m['overlap']:.0%} of copy time hidden under compute (copies {m['copy_seconds']:.3f} s, compute "
            f"{m['compute_seconds']:.3f} s, both {m['both_seconds']:.3f} s; 2 slots of {format_size(size)}, "
            f"{what}{scaled})")
    streaming = m["copy_bandwidth"]
    if pinned_bandwidth:
        share = streaming / pinned_bandwidth
        figures["share_of_pinned"] = share
        text += f"; streaming {streaming / 1e9:.1f} GB/s = {share:.0%} of a raw pinned copy"
        if share < STREAM_GOAL:
            return Check(name, FAIL, f"{text}, below the {STREAM_GOAL:.0%} goal", figures)
    if m["overlap"] < MIN_OVERLAP:
        return Check(name, FAIL, f"{text}: below {MIN_OVERLAP:.0%}, copies and compute take turns "
                                 f"(another process on the GPU, or a driver that serializes copy engines)", figures)
    return Check(name, PASS, text, figures)


def logits_check(device: torch.device, dtype: torch.dtype) -> Check:
    name = "streamed == resident"
    c = compare_in_temp(device, dtype)
    where = f"random 4-layer Llama, layers {'/'.join(c['tiers'])}, {c['dtype']} on {device}"
    if not c["equal"]:
        return Check(name, FAIL, f"streamed logits differ from resident ones by up to {c['max_difference']:.3g} "
                                 f"({where}); please report this", c)
    return Check(name, PASS, f"streamed logits equal resident logits bit for bit ({where}, "
                             f"{format_size(c['bytes_streamed'])} streamed)", c)
