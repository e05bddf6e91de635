"""An LM head read from its file in row chunks at every call, for a CPU whose memory budget cannot keep it.

A 1.5B target's Q6_K head is 191 MB, as much as seven of its decoder layers. Where every decoder layer is
already streamed and the budget is still short, keeping the head resident (memory-mapped) only means its pages
and the draft's evict each other under the memory limit, and come back through page faults in every pass. A
`StreamedHead` reads it instead, like a streamed layer: whole chunks of rows with O_DIRECT into two page-aligned
buffers, the next chunk read while the current one computes. The rows are the store's own ggml blocks and each
chunk goes through the same kernel (`kernels.linear`) as the resident head: a row's logit does not depend on
which chunk holds it (offspec's CPU kernels compute each output row alone; tests/test_streamed_head.py).

Successive calls walk the chunks in alternating directions, so a call starts with the two chunks the previous
one ended on already in the buffers: only the others are read.
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.ggml import KERNEL_TYPES
from offspec.formats.modules import QLinear

from .diskio import ALIGN, FileReader, aligned_empty

CHUNK_BYTES = 8 * 2**20  # about this many weight bytes per read (whole 4 KiB-aligned runs of rows)


def chunk_rows(row_bytes: int, rows: int, target: int = CHUNK_BYTES) -> int:
    """Rows per chunk: about `target` bytes, a multiple of the rows that span whole 4 KiB pages (so every chunk
    starts at the same offset within a page as the first: O_DIRECT reads need aligned offsets)."""
    step = ALIGN // math.gcd(row_bytes, ALIGN)  # e.g. Q6_K at 1536 columns: 1260 B/row -> 1024 rows = 315 pages
    return min(max(step, target // row_bytes // step * step), rows)


def _span(start: int, nbytes: int) -> tuple[int, int, int]:
    """(aligned file offset, bytes to read, skew of `start` in the buffer) for bytes [start, start + nbytes)."""
    aligned = start // ALIGN * ALIGN
    skew = start - aligned
    return aligned, -(-(skew + nbytes) // ALIGN) * ALIGN, skew


def head_bytes_per_read(row_bytes: int, rows: int, offset: int, target: int = CHUNK_BYTES) -> int:
    """Bytes of one read buffer for a head of `rows` rows at file `offset`: what placement charges (x2)."""
    n = chunk_rows(row_bytes, rows, target)
    return _span(offset, n * row_bytes)[1]


class StreamedHead(QLinear):
    """y = x W^T with W's (rows, row_bytes) ggml blocks read from `path` at `offset`, chunk by chunk.

    It is a QLinear (same type, shapes and kernels) whose `qweight` stays a meta placeholder: nothing of W is
    kept between calls but the two chunk buffers. `crcs` are the chunks' checksums (taken when the store was
    checked at load); `verify` ("first", "always", "never") says when a read chunk is checked against them."""

    def __init__(self, head: QLinear, path: Path, offset: int, reader: FileReader, crcs: list[int],
                 verify: str = "first", on_corrupt: Callable[[], str] = lambda: "delete it and start again",
                 target_bytes: int = CHUNK_BYTES):
        torch.nn.Module.__init__(self)
        self.type_id, self.in_features, self.out_features = head.type_id, head.in_features, head.out_features
        self.row_bytes = KERNEL_TYPES[self.type_id].row_bytes(self.in_features)
        self.register_buffer("qweight", torch.empty((self.out_features, self.row_bytes), dtype=torch.uint8,
                                                     device="meta"))
        self.register_buffer("bias", head.bias)
        self.path, self.offset, self.reader = Path(path), offset, reader
        self.rows = chunk_rows(self.row_bytes, self.out_features, target_bytes)
        self.bounds = [(a, min(a + self.rows, self.out_features)) for a in range(0, self.out_features, self.rows)]
        if len(crcs) != len(self.bounds):
            raise ValueError(f"{len(crcs)} checksums for {len(self.bounds)} chunks")
        self.crcs, self.verify, self.on_corrupt = crcs, verify, on_corrupt
        self.verified: set[int] = set()
        size = max(_span(offset + a * self.row_bytes, (b - a) * self.row_bytes)[1] for a, b in self.bounds)
        self.buffers = [aligned_empty(size), aligned_empty(size)]  # 2 x (size,) uint8, page-aligned for O_DIRECT
        self.held: list[Optional[int]] = [None, None]  # the chunk each buffer holds (or is being read into)
        self.pending: list[Optional[Future]] = [None, None]  # the read filling each buffer
        self.reverse = False  # this call's direction (alternates)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="offspec-head")
        self.lock = threading.Lock()  # counters: read by the engine between passes
        self.bytes_total, self.wait_total = 0, 0.0

    # --- reading -------------------------------------------------------------------------------------
    def _read(self, chunk: int, buf: int) -> None:
        """Read `chunk` into buffer `buf` and check it (in the worker thread: `_start`)."""
        a, b = self.bounds[chunk]
        start, nbytes, skew = _span(self.offset + a * self.row_bytes, (b - a) * self.row_bytes)
        self.reader.read(self.path, self.buffers[buf], nbytes, start)
        data = self.buffers[buf][skew : skew + (b - a) * self.row_bytes]  # ((b - a) * row_bytes,) uint8
        if self.verify == "always" or (self.verify == "first" and chunk not in self.verified):
            if zlib.crc32(data.numpy()) & 0xFFFFFFFF != self.crcs[chunk]:
                raise OffspecError(f"the LM head in {self.path} is corrupt (checksum mismatch in rows {a}-{b}); "
                                   f"{self.on_corrupt()}")
            self.verified.add(chunk)
        with self.lock:
            self.bytes_total += (b - a) * self.row_bytes

    def _start(self, chunk: int, buf: int) -> None:
        self.held[buf] = chunk
        self.pending[buf] = self.pool.submit(self._read, chunk, buf)

    def _take(self, chunk: int, keep: Optional[int]) -> int:
        """The buffer holding `chunk`, once read (read now on a miss, into a buffer not holding `keep`)."""
        if chunk not in self.held:
            buf = 1 if self.held[0] == keep and keep is not None else 0
            self._wait(buf)  # no read may still be filling a buffer that is about to be reused
            self._start(chunk, buf)
        buf = self.held.index(chunk)
        self._wait(buf)
        return buf

    def _wait(self, buf: int) -> None:
        future = self.pending[buf]
        if future is None:
            return
        t0 = time.perf_counter()
        try:
            future.result()  # host waits for the read: the weights are late (the pass's io wait)
        except BaseException:
            self.held[buf] = None  # a failed read leaves nothing usable in the buffer
            raise
        finally:
            self.pending[buf] = None
            with self.lock:
                self.wait_total += time.perf_counter() - t0

    def _view(self, chunk: int, buf: int) -> torch.Tensor:
        a, b = self.bounds[chunk]
        skew = _span(self.offset + a * self.row_bytes, 0)[2]
        return self.buffers[buf][skew : skew + (b - a) * self.row_bytes].view(b - a, self.row_bytes)

    # --- computing -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.buffers:
            raise OffspecError("the streamed LM head was closed; load the model again")
        order = list(range(len(self.bounds)))
        if self.reverse:
            order.reverse()
        self.reverse = not self.reverse
        out = None
        try:
            for i, chunk in enumerate(order):
                nxt = order[i + 1] if i + 1 < len(order) else None
                buf = self._take(chunk, keep=nxt)
                if nxt is not None and nxt not in self.held:
                    self._wait(1 - buf)
                    self._start(nxt, 1 - buf)  # read ahead while this chunk computes
                a, b = self.bounds[chunk]
                bias = None if self.bias is None else self.bias[a:b].to(x.dtype)
                y = kernels.linear(x, self._view(chunk, buf), self.type_id, self.in_features, bias)  # (..., b - a)
                if out is None:
                    out = y.new_empty(*y.shape[:-1], self.out_features)  # (..., out_features) logits
                out[..., a:b] = y
        except BaseException:
            self.reverse = False  # an interrupted call: start the next one afresh, in order
            for buf in (0, 1):
                try:
                    self._wait(buf)
                except BaseException:
                    pass  # the read's own error was raised (or is being raised) by the call that needed it
            raise
        return out

    def loading(self) -> bool:
        """The head runs after every layer: it never holds the next pass's first layer back."""
        return False

    def counters(self) -> tuple[int, float]:
        """(weight bytes read, seconds waited for them), cumulative."""
        with self.lock:
            return self.bytes_total, self.wait_total

    def close(self) -> None:
        """Let the buffers go once no read is in flight; the head cannot run afterwards."""
        self.pool.shutdown(wait=True)
        self.buffers, self.held, self.pending = [], [None, None], [None, None]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, streamed from {self.path.name} in {len(self.bounds)} chunks of "
                f"{self.rows} rows")


def chunk_crcs(path: Path, offset: int, row_bytes: int, rows: int, seed: int = 0, target: int = CHUNK_BYTES
               ) -> tuple[list[int], int]:
    """Checksums of a head's chunks (as StreamedHead cuts them), and the crc32 of the bytes before them (`seed`)
    continued over all of them, read once with buffered reads whose pages are dropped afterwards."""
    import os

    n = chunk_rows(row_bytes, rows, target)
    crcs, whole = [], seed
    fd = os.open(path, os.O_RDONLY)
    try:
        for a in range(0, rows, n):
            nbytes = (min(a + n, rows) - a) * row_bytes
            chunk = os.pread(fd, nbytes, offset + a * row_bytes)
            if len(chunk) != nbytes:
                raise OSError(f"{path} is shorter than expected")
            crcs.append(zlib.crc32(chunk) & 0xFFFFFFFF)
            whole = zlib.crc32(chunk, whole)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return crcs, whole & 0xFFFFFFFF
