"""A pre-allocated KV cache whose writes go to slots the engine chooses.

transformers' own caches append in order. Trees need more: a pass writes many nodes that share a
position id (siblings) into distinct slots, then only the accepted path is kept. `SlotKVCache`
is a `transformers.Cache` whose `update()` writes the new keys/values at `write_slots` and returns the
buffer up to `kv_len`; the engine pairs it with a 4D mask over those `kv_len` slots.

Invariant kept by the engine: slots [0, length) hold the committed sequence, slot i = position i.

`BorrowedKVCache` is a draft's view of the target's cache (a draft made from the target, `--draft self`).
"""

from __future__ import annotations

import math
import mmap
from typing import Optional

import torch
from transformers.cache_utils import Cache


def _zeros_like(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of `like`'s dtype and device. On a CPU they are a private anonymous mapping: zero pages the kernel
    provides on first touch, so a cache sized for the whole context costs memory (RSS) only as the conversation
    fills it. (calloc promises the same only for blocks it maps afresh: one glibc serves from a heap it has grown
    past them is zeroed, every page touched, and whether that happens depends on what was freed before: a 16-token
    generate peaked at 2.2 or 2.8 GB from run to run.)"""
    if like.device.type == "cpu" and hasattr(mmap, "MAP_PRIVATE"):
        count = math.prod(shape)
        mapping = mmap.mmap(-1, max(1, count * like.element_size()), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(mapping, dtype=like.dtype, count=count).view(shape)  # the storage keeps the mapping
    return like.new_zeros(shape)


class SlotKVCache(Cache):
    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[])  # we own the storage below instead of HF cache layers
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers  # each (1, kv_heads, capacity, head_dim)
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.length = 0  # committed tokens held in slots [0, length)
        self.write_slots: Optional[torch.Tensor] = None  # (q,) long: where the next forward writes
        self.kv_len = 0  # keys/values returned to attention cover slots [0, kv_len)
        # (capacity,) long: the position of the token each slot holds (slot i = position i for committed tokens;
        # tree nodes and a draft's scratch slots hold others). Sliding windows are over positions, not slots.
        self.positions = torch.arange(capacity)

    # --- driven by the engine -------------------------------------------------------------------
    def prepare(self, write_slots: torch.Tensor, kv_len: int, positions: Optional[torch.Tensor] = None) -> None:
        """Set where the next forward's q tokens are written and how many slots attention sees; `positions` (q,):
        the positions of those tokens (recorded per slot, for sliding windows)."""
        if kv_len > self.capacity:
            raise RuntimeError(f"KV cache overflow: {kv_len} slots needed, {self.capacity} allocated")
        self.write_slots = write_slots
        self.kv_len = kv_len
        if positions is not None:
            if self.positions.device != write_slots.device:
                self.positions = self.positions.to(write_slots.device)
            self.positions.index_copy_(0, write_slots, positions)

    def keep(self, src_slots: torch.Tensor, new_length: int) -> None:
        """Prune: copy `src_slots` (k,) to slots [new_length - k, new_length) and commit up to new_length.

        Used to keep the accepted path of a tree. Source slots are always >= destination slots, and
        index_select materialises them before the write, so overlapping moves are safe.
        """
        k = int(src_slots.numel())
        if k:
            dst = torch.arange(new_length - k, new_length, device=src_slots.device)
            if not torch.equal(src_slots, dst):
                for buf in self.keys + self.values:
                    if buf is not None:
                        buf.index_copy_(2, dst, buf.index_select(2, src_slots))
                self.positions = self.positions.to(src_slots.device)
                self.positions.index_copy_(0, dst, self.positions.index_select(0, src_slots))
        self.length = new_length

    def truncate(self, length: int) -> None:
        """Forget everything from slot `length` on (used when a new prompt shares only a prefix)."""
        self.length = min(self.length, length)

    # --- called by the transformers model --------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        _, h, _, d = key_states.shape
        k_buf, v_buf = self.buffers(layer_idx, key_states, h, d, value_states.shape[-1])
        k_buf.index_copy_(2, self.write_slots, key_states)
        v_buf.index_copy_(2, self.write_slots, value_states)
        return k_buf[:, :, : self.kv_len], v_buf[:, :, : self.kv_len]

    def buffers(self, layer_idx: int, like: torch.Tensor, kv_heads: int, head_dim: int,
                value_dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of a layer, (1, kv_heads, capacity, head_dim) and (..., value_dim or head_dim)
        in `like`'s dtype and device, made on first use (`update`; a compiled layer, offspec.formats.layers, writes
        `write_slots` itself)."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx] = _zeros_like(like, (1, kv_heads, self.capacity, head_dim))
            self.values[layer_idx] = _zeros_like(like, (1, kv_heads, self.capacity, value_dim or head_dim))
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self.num_layers


class BorrowedKVCache(SlotKVCache):
    """A draft's cache over the target's buffers. A draft made from the target (`--draft self`: the same layers,
    heads and dtype) reads the target's own keys and values of the committed tokens: it never prefills a prompt or
    catches up on an accepted path, and holds no cache of its own. It writes only slots at or after the target's
    committed length (the root and its tree's scratch slots), which the target's next pass writes itself before it
    reads them, so the target never reads a key or value it did not compute (`prepare` refuses any other write)."""

    def __init__(self, owner: SlotKVCache):
        super().__init__(owner.num_layers, owner.capacity)
        self.owner = owner
        self.keys, self.values = owner.keys, owner.values  # the same lists: a buffer made by either is both's
        self._floor = 0  # slots [0, _floor) of `positions` hold their own positions (the draft wrote none since)

    def follow(self) -> None:
        """Take the owner's committed slots as this cache's own (length = the owner's)."""
        n = self.owner.length
        lo = min(self._floor, n)
        if n > lo:  # the draft's scratch positions there are the target's committed slots now: slot i = position i
            self.positions[lo:n] = torch.arange(lo, n, device=self.positions.device)
        self.length = self._floor = n

    def prepare(self, write_slots: torch.Tensor, kv_len: int, positions: Optional[torch.Tensor] = None) -> None:
        first = int(write_slots.min())  # sync (CUDA): once per draft forward, the guard of the target's keys
        if first < self.owner.length:
            raise RuntimeError(f"a draft borrowing the target's cache wrote slot {first}, below the target's "
                               f"{self.owner.length} committed slots")
        super().prepare(write_slots, kv_len, positions)

    def keep(self, src_slots: torch.Tensor, new_length: int) -> None:
        raise RuntimeError("a borrowed cache keeps nothing: the target's pass committed its own keys and values")
