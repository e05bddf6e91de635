"""Reading a mixture's experts from SSD as the router picks them, into one expert cache.

Where a mixture's layers do not fit (offspec/offload/placement.py), each layer's dense part stays resident and its
experts stay in the layer's packed file, each expert's gate, up and down blocks one 4 KiB-aligned range with its
own crc32 (offspec/store/packed.py: `LayerSpec.ranges`). A layer's `QExperts` (offspec/formats/experts.py) asks
`fetch(layer, experts)` for the experts its tokens were routed to, in one call per layer and pass; the cache gives
each one's range as a view into one of its slots (the size of the largest expert), reading the ones it does not
hold with O_DIRECT reads (one range each), and dropping others to make room.

Which expert goes is the policy: "lru" (the least recently used) or "lfu" (the one routed to least often in this
process, the least recent of those). An expert routed in the current call is never dropped for another of that
call; the placement makes the cache at least one layer's experts, so a call always fits.

A range is checked against its crc32 the first time it is read (`verify="first"`), at every read ("always") or
never; a mismatch marks the store for a rebuild and is a one-line OffspecError, as for a streamed layer.

`counters()` is the runner's per-pass I/O (bytes read, seconds spent reading: the decode waits for each read) and
`stats()` the expert counts: experts asked for, cache hits, reads and bytes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.errors import OffspecError
from offspec.store.packed import HEADER, payload_crc

from .diskio import FileReader, aligned_empty

POLICIES = ("lru", "lfu")


class ExpertCache:
    """Slots of `unit` bytes in one page-aligned host buffer of `capacity` bytes (whole slots)."""

    def __init__(self, capacity: int, unit: int, reader: FileReader, *, policy: str = "lru", verify: str = "first",
                 on_corrupt: Callable[[], str] = lambda: "delete the model's cache entry to rebuild it"):
        if policy not in POLICIES:
            raise OffspecError(f"unknown expert cache policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.unit, self.reader, self.policy, self.verify, self.on_corrupt = unit, reader, policy, verify, on_corrupt
        self.slots = capacity // unit
        self.buffer = aligned_empty(self.slots * unit)  # (slots * unit,) uint8: every slot page-aligned
        self.free = list(range(self.slots - 1, -1, -1))
        self.slot_of: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
        self.key_of: list[Optional[tuple[int, int]]] = [None] * self.slots
        self.last = [0] * self.slots  # the call that last used each slot
        self.routed: Counter = Counter()  # (layer, expert) -> calls that routed to it (the "lfu" frequency)
        self.calls = 0
        self.sources: dict[int, tuple[Path, tuple]] = {}  # layer -> (its packed file, its expert ranges)
        self.verified: set[tuple[int, int]] = set()
        self.asked = self.hits = self.reads = self.read_bytes = 0
        self.read_seconds = 0.0

    def register(self, layer: int, path: Path, ranges: tuple) -> None:
        """Layer `layer`'s experts live in `path`, expert e at payload range `ranges[e]` (offset, nbytes, crc32)."""
        if max(n for _, n, _ in ranges) > self.unit:
            raise ValueError(f"layer {layer}: an expert is larger than a cache slot")
        self.sources[layer] = (Path(path), tuple(ranges))

    def fetch(self, layer: int, experts: list[int]) -> dict[int, torch.Tensor]:
        """{expert: (range nbytes,) uint8 view of its blocks} for `experts` of `layer`, read where not cached."""
        self.calls += 1
        path, ranges = self.sources[layer]
        out, missing = {}, []
        for e in experts:
            key = (layer, e)
            self.routed[key] += 1
            slot = self.slot_of.get(key)
            if slot is None:
                missing.append(e)
                continue
            self.last[slot] = self.calls
            out[e] = self._view(slot, ranges[e][1])
        self.asked += len(experts)
        self.hits += len(experts) - len(missing)
        for e in missing:
            slot = self._victim()
            offset, nbytes, crc = ranges[e]
            view = self._view(slot, nbytes)
            self.read_seconds += self.reader.read(path, view, nbytes, offset=HEADER + offset)  # waits for the disk
            self.reads += 1
            self.read_bytes += nbytes
            key = (layer, e)
            if self.verify == "always" or (self.verify == "first" and key not in self.verified):
                if payload_crc(view) != crc:
                    self.free.append(slot)
                    raise OffspecError(f"packed layer file {path} is corrupt (expert {e}: checksum mismatch); "
                                       f"{self.on_corrupt()}")
                self.verified.add(key)
            self.slot_of[key], self.key_of[slot], self.last[slot] = slot, key, self.calls
            out[e] = view
        return out

    def _view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffer[slot * self.unit : slot * self.unit + nbytes]

    def _victim(self) -> int:
        """A free slot, else the policy's choice among the slots this call has not used."""
        if self.free:
            return self.free.pop()
        candidates = [s for s in range(self.slots) if self.last[s] != self.calls]
        if not candidates:
            raise OffspecError(f"the expert cache ({self.slots} experts) cannot hold one layer's routed experts")
        if self.policy == "lfu":
            slot = min(candidates, key=lambda s: (self.routed[self.key_of[s]], self.last[s]))
        else:
            slot = min(candidates, key=lambda s: self.last[s])
        del self.slot_of[self.key_of[slot]]
        return slot

    def counters(self) -> tuple[int, float]:
        """(bytes read, seconds spent reading), cumulative: what a pass waited for its experts."""
        return self.read_bytes, self.read_seconds

    def expert_counters(self) -> tuple[int, int]:
        """(experts routed to, of them cache hits), cumulative: one (layer, expert) pair per layer call."""
        return self.asked, self.hits

    def loading(self) -> bool:
        return False  # reads happen inside the layer that needs them: nothing is ever in flight between passes

    def stats(self) -> dict:
        return {"experts_asked": self.asked, "expert_hits": self.hits, "expert_reads": self.reads,
                "expert_read_bytes": self.read_bytes, "expert_read_seconds": self.read_seconds,
                "expert_slots": self.slots, "expert_policy": self.policy}

    def close(self) -> None:
        self.slot_of.clear()
        self.buffer = torch.empty(0, dtype=torch.uint8)


class ExpertStream:
    """One layer's view of the cache: what its QExperts calls (`fetch(experts)`)."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache, self.layer = cache, layer

    def fetch(self, experts: list[int]) -> dict[int, torch.Tensor]:
        return self.cache.fetch(self.layer, experts)
