"""Reading a mixture's experts from SSD as the router picks them, into one expert cache; its slots and policy
(`ExpertSlots`) are shared with the cache of experts held in RAM (offspec/offload/ram_experts.py).

Where a mixture's layers do not fit (offspec/offload/placement.py), each layer's dense part stays resident and its
experts stay in the layer's packed file, each expert's gate, up and down blocks one 4 KiB-aligned range with its
own crc32 (offspec/store/packed.py: `LayerSpec.ranges`). A layer's `QExperts` (offspec/formats/experts.py) asks
`fetch(layer, experts)` for the experts its tokens were routed to, in one call per layer and pass; the cache gives
each one's range as a view into one of its slots (the size of the largest expert), reading the ones it does not
hold with O_DIRECT reads (one range each), and dropping others to make room.

Which expert goes is the policy: "lru" (the least recently used) or "lfu" (the one routed to least often in this
process, the least recent of those). An expert routed in the current call is never dropped for another of that
call; the placement makes the cache at least one layer's experts, so a call always fits.

**Prefetch.** While a layer computes its experts, the next layer's router, applied to this layer's input, predicts
the experts the next layer will ask for, and a reader thread reads those the cache lacks (`prefetch`). It is only
a read ahead: the next layer runs what its own router chooses, waiting for a range still in flight or reading what
was not predicted. A prediction never drops an expert of the running call, and a newer prediction replaces one
not started yet.

A range is checked against its crc32 the first time it is read (`verify="first"`), at every read ("always") or
never; a mismatch marks the store for a rebuild and is a one-line OffspecError, as for a streamed layer.

`counters()` is the runner's per-pass I/O (bytes read, seconds the decode waited for reads), `expert_counters()`
the experts routed to and the cache's hits, and `stats()` all of it with the prefetch's accuracy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.errors import OffspecError
from offspec.store.packed import HEADER, payload_crc

from .diskio import FileReader, aligned_empty

POLICIES = ("lru", "lfu")


class ExpertSlots:
    """Slots of `unit` bytes in one buffer, the (layer, expert) each holds and the policy that picks which goes: what
    the SSD cache here and the RAM-held one (offspec/offload/ram_experts.py) share. Subclasses make `buffer` and fill
    the slots; their counters: `asked` and `hits` per (layer, expert) a call routed to, `reads` and `read_bytes` of
    the ranges they filled, `read_seconds` the decode waited for them."""

    source = "ssd"  # where the experts come from ("ssd", "ram"): the stats say it

    def __init__(self, slots: int, unit: int, policy: str):
        if policy not in POLICIES:
            raise OffspecError(f"unknown expert cache policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.slots, self.unit, self.policy = slots, unit, policy
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.free = list(range(self.slots - 1, -1, -1))
        self.slot_of: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot, once its range is there
        self.key_of: list[Optional[tuple[int, int]]] = [None] * self.slots
        self.last = [0] * self.slots  # the call that last used (or was predicted to use) each slot
        self.pending: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot a read ahead is filling
        self.routed: Counter = Counter()  # (layer, expert) -> calls that routed to it (the "lfu" frequency)
        self.calls = 0
        self.asked = self.hits = self.reads = self.read_bytes = 0
        self.read_seconds = 0.0  # what fetch waited: its own reads, and ranges still in flight
        self.prefetch_reads = self.prefetch_used = self.predicted = self.predicted_right = 0
        self.prefetched: set[tuple[int, int]] = set()  # read ahead, not asked for yet
        self.guess: dict[int, set[int]] = {}  # layer -> the experts last predicted for it

    @property
    def prefetching(self) -> bool:
        """Whether `prefetch` reads anything ahead (ExpertStream asks before it runs the next layer's router)."""
        return False

    def _lookup(self, layer: int, experts: list[int]) -> tuple[dict[int, int], list[int]]:
        """(lock held) One call's start: ({expert: slot} of those held, [those missing]); counts the call, its
        hits and the last prediction for this layer."""
        self.calls += 1
        guess = self.guess.pop(layer, None)
        if guess is not None:
            self.predicted += len(guess)
            self.predicted_right += len(guess & set(experts))
        held, missing = {}, []
        for e in experts:
            key = (layer, e)
            self.routed[key] += 1
            slot = self.slot_of.get(key)
            if slot is None:
                missing.append(e)
                continue
            self.last[slot] = self.calls
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.prefetch_used += 1
            held[e] = slot
        self.asked += len(experts)
        self.hits += len(experts) - len(missing)
        return held, missing

    def _install(self, key: tuple[int, int], slot: int) -> None:
        """(lock held) `slot` now holds `key`'s range."""
        self.slot_of[key], self.key_of[slot], self.last[slot] = slot, key, self.calls

    def _view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffer[slot * self.unit : slot * self.unit + nbytes]

    def _victim(self, strict: bool = True) -> Optional[int]:
        """(lock held) A free slot, else the policy's choice among the slots the running call has not used and no
        read is filling; None where there is none and not `strict` (a read ahead then stops)."""
        if self.free:
            return self.free.pop()
        busy = set(self.pending.values())
        candidates = [s for s in range(self.slots) if self.last[s] != self.calls and s not in busy
                      and self.key_of[s] is not None]
        if not candidates:
            if not strict:
                return None
            raise OffspecError(f"the expert cache ({self.slots} experts) cannot hold one layer's routed experts")
        if self.policy == "lfu":
            slot = min(candidates, key=lambda s: (self.routed[self.key_of[s]], self.last[s]))
        else:
            slot = min(candidates, key=lambda s: self.last[s])
        key = self.key_of[slot]
        del self.slot_of[key]
        self.key_of[slot] = None
        self.prefetched.discard(key)
        return slot

    def counters(self) -> tuple[int, float]:
        """(bytes read, seconds the decode waited for reads), cumulative."""
        return self.read_bytes, self.read_seconds

    def expert_counters(self) -> tuple[int, int]:
        """(experts routed to, of them cache hits), cumulative: one (layer, expert) pair per layer call."""
        return self.asked, self.hits

    def loading(self) -> bool:
        return False  # a read ahead is within a pass: nothing a draft could wait on between passes

    def stats(self) -> dict:
        seconds = self.counters()[1]
        return {"expert_source": self.source, "experts_asked": self.asked, "expert_hits": self.hits,
                "expert_reads": self.reads, "expert_read_bytes": self.read_bytes, "expert_wait_seconds": seconds,
                "expert_slots": self.slots, "expert_policy": self.policy, "prefetch_reads": self.prefetch_reads,
                "prefetch_used": self.prefetch_used,
                "prefetch_accuracy": self.predicted_right / self.predicted if self.predicted else None}


class ExpertCache(ExpertSlots):
    """Slots of `unit` bytes in one page-aligned host buffer of `capacity` bytes (whole slots), filled from SSD."""

    def __init__(self, capacity: int, unit: int, reader: FileReader, *, policy: str = "lru", verify: str = "first",
                 on_corrupt: Callable[[], str] = lambda: "delete the model's cache entry to rebuild it",
                 prefetch: bool = True):
        super().__init__(capacity // unit, unit, policy)
        self.reader, self.verify, self.on_corrupt = reader, verify, on_corrupt
        self.buffer = aligned_empty(self.slots * unit)  # (slots * unit,) uint8: every slot page-aligned
        self.sources: dict[int, tuple[Path, tuple]] = {}  # layer -> (its packed file, its expert ranges)
        self.verified: set[tuple[int, int]] = set()
        self.cv = threading.Condition()
        self.request: Optional[tuple[int, list[int]]] = None  # the prediction the reader thread takes next
        self.error: Optional[BaseException] = None
        self.closed = False
        self.thread = threading.Thread(target=self._prefetcher, name="offspec-experts", daemon=True) \
            if prefetch else None
        if self.thread is not None:
            self.thread.start()

    @property
    def prefetching(self) -> bool:
        return self.thread is not None

    def register(self, layer: int, path: Path, ranges: tuple) -> None:
        """Layer `layer`'s experts live in `path`, expert e at payload range `ranges[e]` (offset, nbytes, crc32)."""
        if max(n for _, n, _ in ranges) > self.unit:
            raise ValueError(f"layer {layer}: an expert is larger than a cache slot")
        self.sources[layer] = (Path(path), tuple(ranges))

    # --- the model's thread -------------------------------------------------------------------------------
    def fetch(self, layer: int, experts: list[int]) -> dict[int, torch.Tensor]:
        """{expert: (range nbytes,) uint8 view of its blocks} for `experts` of `layer`, read where not cached."""
        path, ranges = self.sources[layer]
        with self.cv:
            self._raise()
            if self.request is not None and self.request[0] == layer:
                self.request = None  # too late to read ahead
            t0 = time.perf_counter()
            while any((layer, e) in self.pending for e in experts):  # a read ahead of this call still in flight
                self.cv.wait()
                self._raise()
            self.read_seconds += time.perf_counter() - t0
            held, missing = self._lookup(layer, experts)
            out = {e: self._view(slot, ranges[e][1]) for e, slot in held.items()}
            slots = [self._victim() for _ in missing]
        for e, slot in zip(missing, slots):
            self.read_seconds += self._read(layer, e, slot)  # waits for the disk
            with self.cv:
                self._install((layer, e), slot)
            out[e] = self._view(slot, ranges[e][1])
        return out

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Read ahead the experts of `layer` a prediction names (replacing one not started yet)."""
        if self.thread is None or layer not in self.sources:
            return
        with self.cv:
            self.guess[layer] = set(experts)
            self.request = (layer, list(experts))
            self.cv.notify_all()

    # --- the reader thread ---------------------------------------------------------------------------------
    def _prefetcher(self) -> None:
        try:
            while True:
                with self.cv:
                    while self.request is None and not self.closed:
                        self.cv.wait()
                    if self.closed:
                        return
                    layer, experts = self.request
                    self.request = None
                    todo = []
                    for e in experts:
                        key = (layer, e)
                        if key in self.slot_of or key in self.pending:
                            continue
                        slot = self._victim(strict=False)
                        if slot is None:
                            break  # every slot is in use by the running call
                        self.pending[key] = slot
                        self.last[slot] = self.calls  # kept from the next victims of this prediction
                        todo.append((e, slot))
                for e, slot in todo:
                    self._read(layer, e, slot)
                    with self.cv:
                        del self.pending[(layer, e)]
                        self._install((layer, e), slot)
                        self.prefetched.add((layer, e))
                        self.prefetch_reads += 1
                        self.cv.notify_all()
        except BaseException as exc:  # surfaced to the model's thread by the next fetch
            with self.cv:
                self.error = exc
                self.pending.clear()
                self.cv.notify_all()

    # --- shared (callers hold the lock where it says so) ---------------------------------------------------
    def _read(self, layer: int, e: int, slot: int) -> float:
        """Read expert `e` of `layer` into `slot` (no lock held); returns the seconds it took."""
        path, ranges = self.sources[layer]
        offset, nbytes, crc = ranges[e]
        view = self._view(slot, nbytes)
        seconds = self.reader.read(path, view, nbytes, offset=HEADER + offset)
        key = (layer, e)
        if self.verify == "always" or (self.verify == "first" and key not in self.verified):
            if payload_crc(view) != crc:
                with self.cv:
                    self.free.append(slot)
                raise OffspecError(f"packed layer file {path} is corrupt (expert {e}: checksum mismatch); "
                                   f"{self.on_corrupt()}")
            self.verified.add(key)
        with self.cv:
            self.reads += 1
            self.read_bytes += nbytes
        return seconds

    def _raise(self) -> None:
        """(lock held) The reader thread's failure, on the model's thread."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        self.slot_of.clear()
        self.buffer = torch.empty(0, dtype=torch.uint8)


class ExpertStream:
    """One layer's view of the cache: what its QExperts calls. `fetch(experts)` gives the routed experts' ranges;
    `prefetch(x)` predicts the next layer's experts from this layer's input `x` (T, H) with the next layer's
    router (`next_router`, None for the last layer) and reads them ahead."""

    def __init__(self, cache: ExpertSlots, layer: int, next_router: Optional[Callable] = None,
                 next_layer: int = -1):
        self.cache, self.layer, self.next_router, self.next_layer = cache, layer, next_router, next_layer

    def fetch(self, experts: list[int]) -> dict[int, torch.Tensor]:
        return self.cache.fetch(self.layer, experts)

    def prefetch(self, x: torch.Tensor) -> None:
        if self.next_router is None or not self.cache.prefetching:
            return
        _, _, chosen = self.next_router(x)  # (T, k) the next layer's router on this layer's input
        self.cache.prefetch(self.next_layer, sorted(set(chosen.reshape(-1).tolist())))  # CPU sync: expert ids
