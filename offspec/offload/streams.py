"""Device-generic copy streams and events, so the streamer runs the same code on CUDA and on CPU.

On CUDA: a separate copy stream (`torch.cuda.Stream`), events ordering copies after the compute that last
used a slot and compute after the copy that fills it; nothing here synchronizes the whole device. Events a
host thread may wait on are *blocking* (cudaEventBlockingSync): the waiting thread sleeps instead of spinning
a CPU core. Every call names the device, and the streamer's threads make it current (`bind_thread`), so
`--device cuda:1` never touches GPU 0.
On CPU: there is no asynchronous engine; a copy runs in the calling thread (the streamer's copier thread,
so it still overlaps compute), and an event is complete as soon as it is recorded.
"""

from __future__ import annotations

from typing import Optional

import torch


class Event:
    """A point in a stream's work. `cuda` is None on CPU (already complete)."""

    __slots__ = ("cuda",)

    def __init__(self, cuda: Optional["torch.cuda.Event"] = None):
        self.cuda = cuda

    def synchronize(self) -> None:
        """Host waits until this event's work is done (this event only, not the device); sleeps, never spins."""
        if self.cuda is not None:
            self.cuda.synchronize()  # sync: host waits for one event (the copier/reader threads only)

    def query(self) -> bool:
        return self.cuda is None or self.cuda.query()


DONE = Event()  # a completed event: "nothing to wait for"


class Streams:
    """The compute stream (the device's current one) and a dedicated copy stream on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pinned_staging = self.cuda  # host staging buffers are page-locked (DMA-able) on CUDA
        # CPU: the device memory is host memory, so SSD files can be read straight into the ring slots
        self.reads_into_slots = not self.cuda
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._stalls: list[tuple] = []  # CUDA: (before, after) timing events around compute-side waits
        self.stall_seconds = 0.0  # resolved GPU-side waits

    def bind_thread(self) -> None:
        """Make the device current in the calling (background) thread: CUDA's current device is per thread."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A (nbytes,) uint8 buffer on the device, allocated on the compute stream (a ring slot)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # --- the copy side (called from the copier thread) ------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event) -> Event:
        """Copy src -> dst on the copy stream once `after` (the slot's last compute) is done; returns its event."""
        if not self.cuda:
            dst.copy_(src)  # CPU: a plain memcpy in this (background) thread
            return DONE
        with torch.cuda.stream(self.copy_stream):
            if after.cuda is not None:
                self.copy_stream.wait_event(after.cuda)  # GPU-side wait, no host sync
            dst.copy_(src, non_blocking=True)  # pinned host -> device DMA (or device -> device)
            event = torch.cuda.Event(blocking=True)  # the reader thread may wait on it: sleep, do not spin
            event.record(self.copy_stream)
        return Event(event)

    # --- the compute side (called from the model's forward, main thread) -------------------------
    def compute_wait(self, event: Event) -> None:
        """Make the compute stream wait for `event` (a filled slot) without blocking the host."""
        if event.cuda is None:
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event.cuda)  # GPU-side wait, no host sync
        after.record(stream)
        self._stalls.append((before, after))  # resolved later by `resolve_stalls`, never synchronized here

    def compute_done(self) -> Event:
        """An event after the compute queued so far on the compute stream (e.g. the layer that used a slot,
        or the allocation of the slots: a slot's first fill must not overtake work queued before it)."""
        if not self.cuda:
            return DONE  # CPU compute is synchronous: the layer has finished
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return Event(event)

    def resolve_stalls(self) -> float:
        """Add up the GPU-side waits whose timing events have completed (no sync); returns the running total."""
        pending = []
        for before, after in self._stalls:
            if after.query():
                self.stall_seconds += before.elapsed_time(after) / 1000.0
            else:
                pending.append((before, after))
        self._stalls = pending
        return self.stall_seconds

    def drain_copies(self) -> None:
        """Wait for every queued copy (before the buffers they read or write are reused or freed)."""
        if self.cuda:
            self.copy_stream.synchronize()  # sync: teardown and error recovery only

    def drain(self) -> None:
        """Wait for every queued copy and compute (only when the streamer restarts after an error)."""
        if self.cuda:
            self.copy_stream.synchronize()  # sync: rare error-recovery path only
            torch.cuda.current_stream(self.device).synchronize()  # sync: same
