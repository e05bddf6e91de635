"""Does the copy stream overlap compute? Measured through the real `LayerStreamer` with the model's own layer size.

A few RAM-tier layers of `layer_bytes` (one pinned host copy shared by all of them) stream through a 2-slot ring
while the compute stream runs matmuls that take about as long as one layer's copy. Three timed windows of the
same jobs: copies alone, compute alone, both. With perfect overlap both take as long as the longer of the two;
run one after the other they take the sum:

    overlap = (copy + compute - both) / min(copy, compute)      1 = fully hidden, 0 = serial

The copies-alone window also gives the bandwidth the streamer achieves, beside the raw pinned copy.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch

from offspec.offload.diskio import aligned_empty
from offspec.offload.streamer import LayerSource, LayerStreamer
from offspec.store.packed import LayerSpec, layer_file
from offspec.util.device import sync_compute

MATMUL = 2048  # side of the square matmuls standing in for a layer's compute


def _window(run, device: torch.device) -> float:
    sync_compute(device)  # sync: the window starts with the compute stream idle
    t0 = time.perf_counter()
    run()
    sync_compute(device)  # sync: and ends when its compute (and the copies it waited for) are done
    return time.perf_counter() - t0


def measure_overlap(device: torch.device, dtype: torch.dtype, layer_bytes: int, layers: int = 4, passes: int = 3,
                    repeats: int = 3, matmul: int = MATMUL) -> dict:
    """Seconds of copies alone, compute alone and both over `passes` passes of `layers` streamed layers of
    `layer_bytes`; the overlap share and the achieved copy bandwidth. Works on CPU too (copier thread)."""
    spec = LayerSpec(index=0, file=layer_file(0), nbytes=layer_bytes, tensors=())
    host = aligned_empty(layer_bytes, pin=device.type == "cuda", device=device).fill_(1)  # (layer_bytes,) uint8
    sources = [LayerSource(i, replace(spec, index=i, file=layer_file(i)), ram=host) for i in range(layers)]
    streamer = LayerStreamer(device, sources, ring_slots=2)
    a = torch.randn(matmul, matmul, device=device).to(dtype)  # (matmul, matmul) compute operands
    b = torch.randn(matmul, matmul, device=device).to(dtype)
    reps = [1]  # matmuls per layer, calibrated below to one layer's copy time
    jobs = passes * layers

    def compute() -> None:
        for _ in range(reps[0]):
            torch.mm(a, b)

    def streamed(work) -> None:
        for _ in range(passes):
            for i in range(layers):
                streamer.acquire(i)  # the compute stream waits for this layer's copy (GPU-side)
                work()
                streamer.release(i)

    def timed_streaming(work) -> float:
        ahead = streamer.settle()  # the window starts with nothing in flight: `ahead` slots already filled
        copies[0] = jobs - ahead
        return _window(lambda: streamed(work), device)

    copies = [jobs]
    try:
        streamed(lambda: None)  # warm-up: threads, events, first touches
        copy_alone = statistics.median(timed_streaming(lambda: None) for _ in range(repeats))
        per_copy = copy_alone / copies[0]
        _window(compute, device)  # warm-up (kernel selection)
        one = min(_window(compute, device) for _ in range(3))
        reps[0] = max(1, math.ceil(per_copy / one))
        compute_alone = statistics.median(_window(lambda: [compute() for _ in range(jobs)], device)
                                          for _ in range(repeats))
        both = statistics.median(timed_streaming(compute) for _ in range(repeats))
    finally:
        streamer.close()  # drains the copy stream, then releases the ring and the pinned copy
        del host, sources
    serial, hidden = copy_alone + compute_alone, min(copy_alone, compute_alone)
    return {"layer_bytes": layer_bytes, "layers": layers, "passes": passes, "copies_timed": copies[0],
            "matmuls_per_layer": reps[0], "copy_seconds": copy_alone, "compute_seconds": compute_alone,
            "both_seconds": both, "overlap": max(0.0, min(1.0, (serial - both) / hidden)) if hidden > 0 else 0.0,
            "copy_bandwidth": copies[0] * layer_bytes / copy_alone if copy_alone > 0 else 0.0}
