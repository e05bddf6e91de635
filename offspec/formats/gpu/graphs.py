"""CUDA graphs for offspec's CUDA layers: a fixed-shape call captured once per key, then replayed.

A draft step or a target layer is ~15-20 kernels; launched one by one from Python they cost more than they compute
at a few rows. Captured, a whole step replays in one launch. What varies from call to call goes in through static
input buffers; shapes are fixed per key by bucketing:

- rows: a pass of n rows runs as `bucket(n)` rows, padded by repeating the last row (`pad_rows`). Every kernel is
  batch-invariant, so a padded row computes the last real row's bits again and writes the same bits into the same
  cache slot: the duplicate write is harmless, and the real rows' results are those of an unpadded call.
- the tail of the attention pattern (attention.TailKeys): its length L rounded up the same way (`pad_keys`).

Keys are the caller's: (the draft, rows bucket, tail bucket) for a draft step; (ring slot, rows bucket, tail
bucket) for a streamed target layer, whose weights are the slot's bytes at a fixed address (the layer's norms and
biases must be read from the slot too, not from per-pass copies). Outputs of a replay live in the graphs' memory
pool until the next replay of any graph of the same `Graphs`: consume or copy them first (a layer stack passes each
output into the next graph's static input by copy before that graph replays).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .attention import TailKeys

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # rows of a captured call; more rows run eagerly


def bucket(n: int, buckets: Sequence[int] = BUCKETS) -> Optional[int]:
    """The smallest bucket of at least n, or None (above the largest: no graph)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(n, ...) -> (rows, ...): t, then its last row repeated (n >= 1, rows >= n)."""
    n = t.shape[0]
    if n == rows:
        return t
    return torch.cat([t, t[-1:].expand(rows - n, *t.shape[1:])])


def pad_keys(keys: TailKeys, rows: int, tail: int) -> TailKeys:
    """The attention pattern of `pad_rows`' rows: padded rows see what the last row sees; the tail list widened to
    `tail` columns (the kernel reads count[i] entries of a row, never the padding)."""
    gather = keys.gather
    if gather.shape[1] < tail:
        gather = torch.cat([gather, gather.new_zeros((gather.shape[0], tail - gather.shape[1]))], dim=1)
    return TailKeys(keys.prefix, pad_rows(gather, rows), pad_rows(keys.count, rows))


class Captured(NamedTuple):
    replay: Callable[[], None]
    inputs: tuple  # the static input tensors the graph reads
    outputs: Any  # what the captured call returned (tensors in the graphs' pool)


class CudaCapturer:
    """Captures with torch.cuda: a warm-up call on a side stream (Triton compiles, the allocator settles), then the
    capture into one memory pool shared by all of this capturer's graphs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn: Callable, static: tuple) -> Captured:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))  # the inputs were written on the compute stream
        with torch.cuda.stream(side):
            fn(*static)  # warm-up: the same inputs, so its cache writes are the ones the replay makes
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static)
        return Captured(graph.replay, static, outputs)


class Graphs:
    """Captured calls by key: `graphs(key, fn, *inputs)` returns fn(*inputs)'s outputs, from a replay."""

    def __init__(self, capturer: Any):
        self.capturer = capturer
        self.entries: dict[Any, Captured] = {}
        self.captures = self.replays = 0

    @classmethod
    def on(cls, device: torch.device) -> "Graphs":
        return cls(CudaCapturer(device))

    def __call__(self, key: Any, fn: Callable, *inputs: torch.Tensor) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            static = tuple(t.clone() for t in inputs)  # the graph reads these addresses on every replay
            entry = self.entries[key] = self.capturer.capture(fn, static)
            self.captures += 1
        else:
            for dst, src in zip(entry.inputs, inputs):
                if dst.shape != src.shape or dst.dtype != src.dtype:
                    raise ValueError(f"graph {key!r}: input {tuple(src.shape)} {src.dtype} where it was captured "
                                     f"with {tuple(dst.shape)} {dst.dtype}")
                dst.copy_(src)
        entry.replay()
        self.replays += 1
        return entry.outputs

    def clear(self) -> None:
        """Drop every graph (their pool memory goes back to the allocator once nothing references it)."""
        self.entries.clear()


TAIL_BUCKETS = (16, 64, 256, 1024, 4096, 16384)  # tail lengths of a captured call (the draft's grow every step)


def run_bucketed(graphs: Optional[Graphs], key: Any, fn: Callable, h: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, keys: TailKeys) -> torch.Tensor:
    """fn(h, cos, sin, slots, prefix, gather, count) -> (rows, E) for n rows: replayed from the graph of (key, rows
    bucket, tail bucket), captured on first use, the inputs padded as `pad_rows` and `pad_keys` say; run as it is
    where `graphs` is None or a size is past its buckets. Returns the n real rows."""
    n = h.shape[0]
    rows, tail = bucket(n), bucket(keys.gather.shape[1], TAIL_BUCKETS)
    if graphs is None or rows is None or tail is None:
        return fn(h, cos, sin, slots, keys.prefix, keys.gather, keys.count)
    padded = pad_keys(keys, rows, tail)
    out = graphs((key, rows, tail), fn, pad_rows(h, rows), pad_rows(cos, rows), pad_rows(sin, rows),
                 pad_rows(slots, rows), padded.prefix, padded.gather, padded.count)
    return out[:n]
