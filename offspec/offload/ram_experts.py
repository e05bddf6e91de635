"""A mixture's experts held in host RAM (pinned on CUDA), the routed ones copied into an expert cache on the device.

Where a mixture's layers do not fit the device but all its experts fit the RAM budget (offspec/offload/placement.py),
each layer's dense part is resident on the device and its experts are read once at load into one host buffer per
layer (pinned on CUDA: copies from it are DMA), each expert's gate, up and down blocks together, checked against
their crc32 there. A layer's QExperts asks `fetch(layer, experts)` for the experts its tokens were routed to; this
cache gives each one as a view into one of its device slots, copying in the ones it does not hold, and drops
others to make room by the same policies as the SSD cache (`ExpertSlots`, offspec/offload/experts.py): the hot
experts stay on the device, the rest cross the link only when routed.

**Streams (CUDA).** A miss is copied on the compute stream, just before the kernels that read it: stream order
makes them wait for it, with no host sync. A read ahead (`prefetch`: the next layer's router on this layer's input,
as for the SSD cache) copies on a side stream while this layer computes; that stream first waits for the work
already queued on the compute stream (the last readers of the slots it overwrites), and each slot it fills gets an
event that the compute stream waits on before the slot is read or overwritten again. A prediction is only a copy
ahead: what runs is what the real router chose.

On a CPU (a --ram-mem given) the same code copies with memcpy, a read ahead at the moment it is predicted.

`counters()` gives the bytes copied and the seconds the compute stream spent on the misses' copies (timed with CUDA
events, summed once they have completed: never a sync of its own; on a CPU, the copies' wall time).
"""

from __future__ import annotations

import contextlib
import time

import torch

from .diskio import aligned_empty
from .experts import ExpertSlots


class RamExpertCache(ExpertSlots):
    """Slots of `unit` bytes in one device buffer of `capacity` bytes (whole slots), filled from host views."""

    source = "ram"

    def __init__(self, capacity: int, unit: int, device: torch.device, *, policy: str = "lru",
                 prefetch: bool = True):
        super().__init__(capacity // unit, unit, policy)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buffer = (torch.empty(self.slots * unit, dtype=torch.uint8, device=self.device) if self.cuda
                       else aligned_empty(self.slots * unit))  # (slots * unit,) uint8: every slot page-aligned
        self.host: dict[int, list[torch.Tensor]] = {}  # layer -> per expert its (nbytes,) uint8 host view
        self.side = torch.cuda.Stream(self.device) if self.cuda and prefetch else None  # read-ahead copies
        self.read_ahead = prefetch
        self.ready: dict[int, torch.cuda.Event] = {}  # slot -> the side-stream copy filling it (CUDA)
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # a call's miss copies, not yet summed

    @property
    def prefetching(self) -> bool:
        return self.read_ahead

    def register(self, layer: int, views: list[torch.Tensor]) -> None:
        """Layer `layer`'s experts: views[e] (nbytes,) uint8, expert e's blocks in host memory (pinned on CUDA)."""
        if max(int(v.numel()) for v in views) > self.unit:
            raise ValueError(f"layer {layer}: an expert is larger than a cache slot")
        self.host[layer] = list(views)

    def fetch(self, layer: int, experts: list[int]) -> dict[int, torch.Tensor]:
        """{expert: (nbytes,) uint8 device view of its blocks} for `experts` of `layer`, copied where not held."""
        host = self.host[layer]
        held, missing = self._lookup(layer, experts)
        for slot in held.values():
            self._wait(slot)  # a read ahead into it: finished before the kernels read it
        out = {e: self._view(slot, host[e].numel()) for e, slot in held.items()}
        if not missing:
            return out
        slots = [self._victim() for _ in missing]
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        for e, slot in zip(missing, slots):
            self._wait(slot)  # a read ahead still filling it (unasked for, now dropped) goes first
            view = self._view(slot, host[e].numel())
            view.copy_(host[e], non_blocking=self.cuda)  # compute stream: the kernels that read it come after
            self._install((layer, e), slot)
            out[e] = view
            self.reads += 1
            self.read_bytes += int(host[e].numel())
        if self.cuda:
            end.record(torch.cuda.current_stream(self.device))
            self.timing.append((start, end))
        else:
            self.read_seconds += time.perf_counter() - t0
        return out

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Copy ahead the experts of `layer` a prediction names, into slots the running call does not hold."""
        if not self.read_ahead or layer not in self.host:
            return
        self.guess[layer] = set(experts)
        todo = []
        for e in experts:
            if (layer, e) in self.slot_of:
                continue
            slot = self._victim(strict=False)
            if slot is None:
                break  # every slot is in use by the running call
            todo.append((e, slot))
        if not todo:
            return
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))  # the slots' last readers first
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            for e, slot in todo:
                view = self._view(slot, self.host[layer][e].numel())
                view.copy_(self.host[layer][e], non_blocking=self.cuda)
                self._install((layer, e), slot)
                self.prefetched.add((layer, e))
                self.prefetch_reads += 1
                self.reads += 1
                self.read_bytes += int(view.numel())
                if self.side is not None:
                    event = torch.cuda.Event()
                    event.record(self.side)
                    self.ready[slot] = event

    def _wait(self, slot: int) -> None:
        """The compute stream waits (on the device, not the host) for a read ahead into `slot`."""
        event = self.ready.pop(slot, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def counters(self) -> tuple[int, float]:
        """(bytes copied, seconds of the misses' copies on the compute stream), cumulative; CUDA copies count once
        their end event has completed (after a pass, they have: its logits were read)."""
        pending = []
        for start, end in self.timing:
            if end.query():  # no sync: only what has completed
                self.read_seconds += start.elapsed_time(end) / 1000
            else:
                pending.append((start, end))
        self.timing = pending
        return self.read_bytes, self.read_seconds

    def close(self) -> None:
        if self.side is not None:
            self.side.synchronize()  # no copy ahead in flight into memory the allocator may hand out again
        self.slot_of.clear()
        self.host.clear()
        self.ready.clear()
        self.timing = []
        self.buffer = torch.empty(0, dtype=torch.uint8)

