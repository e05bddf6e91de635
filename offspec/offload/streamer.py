"""The layer streamer: a ring of device slots that streamed layers rotate through, fed ahead of compute.

Work is a cycle of *jobs*, one per streamed layer in execution order, wrapping from the last streamed layer
of a pass to the first of the next (so the next pass's first layers load while the draft grows its tree).
Job j uses slot j % N (N >= 2 ring slots). Three actors, each in order:

- the **reader** thread (only when layers are on SSD) reads job j's packed file into a host staging buffer
  (M of them, pinned on CUDA) as soon as one is free: it runs up to M files ahead of the copies;
- the **copier** thread copies the payload (from the staging buffer, or the layer's RAM copy) into slot
  j % N on the copy stream, after the compute event of job j - N (the slot's previous user), and records
  a copy event;
- the **model** (main thread, through the forward hooks) `acquire`s job j: the compute stream waits for the
  copy event (GPU-side; on CPU the copy is already done), the layer runs on views into the slot; `release`
  records the compute event that frees the slot for job j + N.

Host-side waits happen only in the background threads and in `acquire` when the weights are not there yet
(that time is the pass's io wait). On CPU the same classes run with `streams.Streams` doing plain copies.

Where the device memory *is* host memory (CPU) and layers come from SSD, there is no staging copy: the files
are read straight into the slots (page-aligned, O_DIRECT), each slot holding a whole packed file, and the
staging budget buys more slots instead. Two **filler** threads then take jobs in order and read (or, for a
RAM-tier layer, copy) into slot j % N as soon as job j - N is released: two reads in flight, which a disk
serves faster than one, and no memcpy of every streamed byte competing with compute for the cores.

Buffers are never reused or freed under a copy in flight: a slot's first fill waits for the compute queued
before the ring was allocated (the allocator may hand out memory that queued kernels still read), a staging
buffer is refilled only after the copy that read it, and `close()` drains the copy stream before it lets the
slots, staging buffers and RAM copies go (pinned host memory is unpinned as soon as they are gone).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.errors import OffspecError
from offspec.store.packed import HEADER, LayerSpec, check_header, payload_crc

from .diskio import FileReader, aligned_empty
from .hostmem import page_round
from .streams import DONE, Event, Streams

# reads in flight when files are read straight into slots: this VM's disk gave 0.75-0.89 GB/s with two O_DIRECT
# readers against 0.63-0.81 with one (docs/design/offloading.md)
FILLERS = 2


@dataclass
class LayerSource:
    """Where a streamed layer's payload comes from: a host copy (RAM tier) or its packed file (SSD tier)."""

    index: int  # decoder layer index
    spec: LayerSpec
    ram: Optional[torch.Tensor] = None  # (spec.nbytes,) uint8 host payload, pinned on CUDA
    path: Optional[Path] = None  # the packed file


class _Pipeline:
    """State shared by the streamer and its two threads (kept apart so the streamer can be garbage collected)."""

    def __init__(self, device: torch.device, order: list[LayerSource], ring_slots: int, staging_buffers: int,
                 reader: FileReader, set_id: str, verify: str, on_corrupt: Callable[[], str],
                 streams: Optional[Streams] = None):
        self.device, self.order, self.k = device, order, len(order)
        self.streams = streams or Streams(device)
        self.reader, self.set_id, self.verify, self.on_corrupt = reader, set_id, verify, on_corrupt
        ssd = [s for s in order if s.path is not None]
        # CPU with layers on SSD: files are read into the slots themselves (see the module docstring)
        self.direct = bool(ssd) and self.streams.reads_into_slots
        self.n = ring_slots + staging_buffers if self.direct else ring_slots
        self.offset = HEADER if self.direct else 0  # where a slot's payload starts (after the file's header)
        with torch.no_grad():
            if self.direct:
                self.slot_bytes = page_round(max(s.spec.file_bytes for s in order))
                # ring: n x (slot_bytes,) uint8 host buffers, page-aligned for O_DIRECT; a slot holds a whole file
                self.slots = [aligned_empty(self.slot_bytes) for _ in range(self.n)]
            else:
                self.slot_bytes = max(s.spec.nbytes for s in order)
                # ring: n x (slot_bytes,) uint8 on the device; a layer's tensors are views into one slot
                self.slots = [self.streams.empty(self.slot_bytes) for _ in range(self.n)]
            # the slots' first fills wait for this: compute queued before the allocation may still use that memory
            self.allocated = self.streams.compute_done()
            file_bytes = max((s.spec.file_bytes for s in ssd), default=0)
            # staging: m x (file_bytes,) uint8 host buffers, page-aligned (O_DIRECT), pinned (exact pages) on CUDA
            self.staging = [aligned_empty(file_bytes, pin=self.streams.pinned_staging, device=device)
                            for _ in range(max(1, staging_buffers))] if ssd and not self.direct else []
        self.m = len(self.staging)
        self.closed = False
        self.cv = threading.Condition()
        self.verified: set[int] = set()  # layers whose checksum passed in this process
        # cumulative statistics
        self.bytes_total = 0  # payload bytes consumed by compute
        self.wait_total = 0.0  # host seconds `acquire` waited for weights
        self.read_seconds = 0.0  # reader busy time
        self.read_bytes = 0
        self.copy_seconds = 0.0  # copier time (CPU: the memcpy; CUDA: enqueueing)
        self.threads: list[threading.Thread] = []
        self._reset(0)
        self.start()

    # --- lifecycle ---------------------------------------------------------------------------------
    def _reset(self, base: int) -> None:
        self.base = base  # position in `order` of job 0
        self.issued = 0  # jobs whose copy has been enqueued
        self.released = 0  # jobs whose compute has been queued and released
        self.holding = False  # a job is acquired and not yet released
        self.ready: dict[int, int] = {}  # job -> staging buffer holding its file
        self.staging_owner: list[Optional[int]] = [None] * self.m
        self.staging_free: list[Event] = [DONE] * self.m  # copy that last read each staging buffer
        self.compute_events: list[Event] = [self.allocated] * self.n  # a slot's previous user: none yet
        self.copy_events: list[Event] = [DONE] * self.n
        self.next_job = 0  # direct reads: the next job a filler takes
        self.filled: set[int] = set()  # direct reads: jobs filled out of order (ahead of `issued`)
        self.error: Optional[BaseException] = None
        self.stop = False

    def start(self) -> None:
        if self.direct:
            self.threads = [threading.Thread(target=self._filler, name=f"offspec-filler-{i}", daemon=True)
                            for i in range(min(FILLERS, self.n))]
        else:
            self.threads = [threading.Thread(target=self._copier, name="offspec-copier", daemon=True)]
            if self.m:
                self.threads.append(threading.Thread(target=self._reader, name="offspec-reader", daemon=True))
        for t in self.threads:
            t.start()

    def stop_threads(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads = []

    def close(self) -> None:
        """Stop the threads, wait for the copies they queued, then let every buffer go (idempotent)."""
        if self.closed:
            return
        self.stop_threads()
        self.streams.drain_copies()  # no copy may still read a staging buffer or write a slot once they are freed
        self.closed = True
        self.slots, self.staging, self.order, self.ready = [], [], [], {}  # device slots, pinned host memory

    def restart(self, position: int) -> None:
        """Start the cycle again at `position` (after an interrupted pass). Rare: waits for all queued work."""
        self.stop_threads()
        self.streams.drain()
        self._reset(position)
        self.start()

    def source(self, job: int) -> LayerSource:
        return self.order[(self.base + job) % self.k]

    # --- background threads ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        with self.cv:
            self.error = exc
            self.cv.notify_all()

    def _reader(self) -> None:
        try:
            self.streams.bind_thread()
            with torch.inference_mode():
                job, b = 0, 0
                while True:
                    src = self.source(job)
                    if src.path is None:
                        job += 1
                        continue
                    with self.cv:
                        while not self.stop and self.staging_owner[b] is not None:
                            self.cv.wait()
                        if self.stop:
                            return
                        free = self.staging_free[b]
                    free.synchronize()  # sync: this thread waits for the copy that last read buffer b
                    seconds = self.reader.read(src.path, self.staging[b], src.spec.file_bytes)
                    self._check(src, self.staging[b])
                    with self.cv:
                        self.read_seconds += seconds
                        self.read_bytes += src.spec.file_bytes
                        self.staging_owner[b] = job
                        self.ready[job] = b
                        self.cv.notify_all()
                    job, b = job + 1, (b + 1) % self.m
        except BaseException as exc:  # surfaced to the model's thread by `acquire`
            self._fail(exc)

    def _filler(self) -> None:
        """Direct reads (CPU): take the next job, wait for its slot, read its file (or copy its RAM payload) into it."""
        try:
            with torch.inference_mode():
                while True:
                    with self.cv:
                        while not self.stop and self.next_job - self.released >= self.n:  # slot still in use
                            self.cv.wait()
                        if self.stop:
                            return
                        job = self.next_job
                        self.next_job += 1
                    src, slot = self.source(job), self.slots[job % self.n]
                    t0 = time.perf_counter()
                    if src.path is not None:
                        self.reader.read(src.path, slot, src.spec.file_bytes)
                        self._check(src, slot)
                    else:
                        slot[HEADER : HEADER + src.spec.nbytes].copy_(src.ram)  # (nbytes,) RAM tier: a memcpy
                    seconds = time.perf_counter() - t0
                    with self.cv:
                        if src.path is not None:
                            self.read_seconds += seconds
                            self.read_bytes += src.spec.file_bytes
                        else:
                            self.copy_seconds += seconds
                        self.filled.add(job)
                        while self.issued in self.filled:  # `acquire` sees jobs ready in order
                            self.filled.discard(self.issued)
                            self.issued += 1
                        self.cv.notify_all()
        except BaseException as exc:  # surfaced to the model's thread by `acquire`
            self._fail(exc)

    def _check(self, src: LayerSource, buf: torch.Tensor) -> None:
        problem = check_header(bytes(buf[:HEADER].numpy()), self.set_id, src.spec)
        if problem is None and (self.verify == "always" or (self.verify == "first" and src.index not in self.verified)):
            if payload_crc(buf[HEADER : HEADER + src.spec.nbytes]) != src.spec.crc32:
                problem = "checksum mismatch"
            else:
                self.verified.add(src.index)
        if problem is not None:
            hint = self.on_corrupt()
            raise OffspecError(f"packed layer file {src.path} is corrupt ({problem}); {hint}")

    def _copier(self) -> None:
        try:
            self.streams.bind_thread()
            with torch.inference_mode():
                job = 0
                while True:
                    with self.cv:
                        while not self.stop and job - self.released >= self.n:  # slot job % n still in use
                            self.cv.wait()
                        src = self.source(job)
                        while not self.stop and src.path is not None and job not in self.ready:
                            self.cv.wait()
                        if self.stop:
                            return
                        b = self.ready.pop(job) if src.path is not None else -1
                        slot = job % self.n
                        after = self.compute_events[slot]
                    nbytes = src.spec.nbytes
                    data = self.staging[b][HEADER : HEADER + nbytes] if b >= 0 else src.ram  # (nbytes,) uint8
                    t0 = time.perf_counter()
                    event = self.streams.copy(self.slots[slot][:nbytes], data, after)
                    seconds = time.perf_counter() - t0
                    with self.cv:
                        self.copy_seconds += seconds
                        self.copy_events[slot] = event
                        if b >= 0:
                            self.staging_owner[b] = None
                            self.staging_free[b] = event
                        self.issued = job + 1
                        self.cv.notify_all()
                    job += 1
        except BaseException as exc:
            self._fail(exc)


class LayerStreamer:
    """Streams `order`'s layers through a ring of device slots. `counters()` is what `ModelRunner.io` reads."""

    def __init__(self, device: torch.device, order: list[LayerSource], *, ring_slots: int = 2,
                 staging_buffers: int = 2, reader: Optional[FileReader] = None, set_id: str = "",
                 verify: str = "first", on_corrupt: Callable[[], str] = lambda: "delete it and start again",
                 streams: Optional[Streams] = None):
        if not order:
            raise ValueError("nothing to stream")
        self.device = torch.device(device)
        self.reader = reader or FileReader()
        self._p = _Pipeline(self.device, order, ring_slots, staging_buffers, self.reader, set_id, verify, on_corrupt,
                            streams)
        self._position = {s.index: i for i, s in enumerate(order)}
        self._finalizer = weakref.finalize(self, self._p.close)  # stop the threads when the streamer goes

    @property
    def layers(self) -> list[int]:
        return [s.index for s in self._p.order]

    @property
    def slot_bytes(self) -> int:
        return self._p.slot_bytes

    @property
    def closed(self) -> bool:
        return self._p.closed

    def acquire(self, layer: int) -> torch.Tensor:
        """The (nbytes,) uint8 device payload of `layer`, ready for the compute stream. Called before its forward."""
        p = self._p
        if p.closed:
            raise OffspecError("the layer streamer was closed; load the model again")
        job = p.released
        if p.holding or p.source(job).index != layer:  # a pass was interrupted, or layers run out of order
            p.restart(self._position[layer])
            job = 0
        with p.cv:
            if p.issued <= job and p.error is None:
                t0 = time.perf_counter()
                while p.issued <= job and p.error is None:
                    p.cv.wait()  # host waits for the copier: the weights are late
                p.wait_total += time.perf_counter() - t0
            if p.error is not None:
                if isinstance(p.error, OffspecError):
                    raise p.error
                raise OffspecError(f"streaming layer {layer} failed: {p.error}") from p.error
            slot = job % p.n
            event = p.copy_events[slot]
        p.streams.compute_wait(event)  # GPU-side wait for the copy; no host sync
        p.holding = True
        spec = p.source(job).spec
        p.bytes_total += spec.nbytes
        return p.slots[slot][p.offset : p.offset + spec.nbytes]

    def release(self, layer: int) -> None:
        """After `layer`'s forward was queued: its slot may be refilled once that compute is done."""
        p = self._p
        if not p.holding:  # its acquire failed (the forward hook runs anyway): nothing to release
            return
        event = p.streams.compute_done()
        with p.cv:
            p.compute_events[p.released % p.n] = event
            p.released += 1
            p.holding = False
            p.cv.notify_all()

    def loading(self) -> bool:
        """Whether the next layer to run is not here yet: between passes, the next pass's first streamed layer is
        still being read or copied (the draft may grow the tree meanwhile; the engine asks). No wait, no sync."""
        p = self._p
        with p.cv:
            if p.closed or p.error is not None or p.holding:
                return False  # an error surfaces in `acquire`; a held layer is running
            job = p.released
            return p.issued <= job or not p.copy_events[job % p.n].query()  # query: no host wait

    def settle(self) -> int:
        """Wait until the ring holds the next jobs and their copies are done, so that a timing window starts with
        nothing in flight (benchmarks, `offspec doctor`). Returns how many jobs are ready ahead (the ring size)."""
        p = self._p
        with p.cv:
            while p.error is None and not p.stop and p.issued < p.released + p.n:
                p.cv.wait()  # host waits for the copier to fill the ring
        p.streams.drain_copies()  # sync: the copy stream, outside any timed window
        return p.issued - p.released

    def counters(self) -> tuple[int, float]:
        """(weight bytes streamed, seconds waited for weights), cumulative. Waits include GPU-side stalls
        whose timing events have completed (they are resolved lazily, without a sync)."""
        p = self._p
        return p.bytes_total, p.wait_total + p.streams.resolve_stalls()

    def stats(self) -> dict:
        p = self._p
        bytes_total, wait = self.counters()
        return {"bytes_streamed": bytes_total, "wait_seconds": wait, "read_bytes": p.read_bytes,
                "read_seconds": p.read_seconds, "copy_seconds": p.copy_seconds, "read_mode": self.reader.mode,
                "ring_slots": p.n, "staging_buffers": p.m, "slot_bytes": self.slot_bytes, "direct_to_slots": p.direct}

    def close(self) -> None:
        """Stop streaming and release the ring slots, the (pinned) staging buffers and the RAM-tier copies, once
        the copies in flight are done. The layers cannot run afterwards."""
        self._finalizer()
