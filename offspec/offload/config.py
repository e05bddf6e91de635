"""Offloading settings: one frozen dataclass and every default in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from offspec.config import QUANTS
from offspec.errors import OffspecError
from offspec.util.paths import cache_dir
from offspec.util.sizes import parse_optional_size
from offspec.util.writable import check_writable_dir

from .estimates import PREFILL_TOKENS

RING_SLOTS = 2  # device slots the streamed layers rotate through (>= 2: one computes while the next loads)
STAGING_BUFFERS = 2  # host staging buffers the SSD reader fills ahead of the copies
FREE_FRACTION = 0.92  # share of the free device memory (or available RAM) a default budget takes
# device memory offspec uses beyond its tensors (allocator slack, kernel workspaces, Python objects; on CUDA
# also the context): charged to the device budget with the resident parts
WORKSPACE = {"cuda": 512 * 2**20, "cpu": 48 * 2**20}
HOST_RESERVE = 2 * 10**9  # RAM left to the OS and everything else when the host RAM budget defaults
# Assumed speeds for the *predicted* pass time of the placement summary (`offspec bench offload` measures them).
ASSUMED_BANDWIDTH = {  # bytes/s
    "cuda": {"link": 20e9, "disk": 2e9, "memory": 1.5e12},  # PCIe 4 x16 pinned copies, NVMe, HBM
    "cpu": {"link": 8e9, "disk": 1e9, "memory": 12e9},  # memcpy into slots, SSD, DRAM
}


MIN_FIT_BUDGET = 64  # the smallest max_budget / max_context the loader lowers defaults to (fit_limits)
MIN_FIT_CONTEXT = 1024
MIN_FIT_PREFILL = 128  # prefill passes of a streamed target: at least this many tokens each


@dataclass(frozen=True)
class OffloadConfig:
    """Where the target's decoder layers may live. Sizes are bytes; None = derived from what is free."""

    device_mem: Optional[int] = None  # everything offspec puts on the device: resident parts, KV caches, slots
    ram_mem: Optional[int] = None  # host RAM for layers streamed from RAM (pinned on CUDA) and SSD staging
    quant: str = "none"  # a float target stored once as: none, int4 (ggml Q4_1), int8 (ggml Q8_0), nf4 (CUDA)
    draft_quant: str = "none"  # the same for a float draft (kept resident); a GGUF keeps its own format
    offload_dir: Optional[Path] = None  # packed per-layer files; None = <cache dir>/offload
    max_context: int = 4096  # conversation tokens the KV caches hold (sizes the KV-cache headroom)
    max_budget: int = 4096  # largest tree (sizes the KV-cache and activation headroom)
    ring_slots: int = RING_SLOTS
    staging_buffers: int = STAGING_BUFFERS
    direct_io: bool = True  # SSD reads with O_DIRECT (no page cache); falls back to buffered + DONTNEED
    verify: str = "first"  # checksum of each packed file: on its "first" read in a process, "always" or "never"
    pack_always: bool = False  # use the packed store even when every layer fits (tests, benchmarks)
    # limits the user left at their defaults ("max_budget", "max_context"): where the resident parts would not fit
    # the device budget, the loader lowers them (budget first, to MIN_FIT_BUDGET / MIN_FIT_CONTEXT) and says so
    fit_limits: tuple[str, ...] = ()
    min_budget: int = 64  # never below the tree budget asked for
    prefill_tokens: int = PREFILL_TOKENS  # the smallest prefill pass the activation reserve must hold
    # a CPU's LM head: "auto" (streamed from SSD in chunks where the resident parts do not fit with it),
    # "always" or "never" (offspec/offload/head.py)
    stream_head: str = "auto"

    def smaller_limits(self) -> Optional["OffloadConfig"]:
        """The next smaller max_budget / max_context this config may fall back to, or None."""
        floor = max(MIN_FIT_BUDGET, self.min_budget)
        if "max_budget" in self.fit_limits and self.max_budget > floor:
            return replace(self, max_budget=max(floor, self.max_budget // 2))
        if "max_context" in self.fit_limits and self.max_context > MIN_FIT_CONTEXT:
            return replace(self, max_context=max(MIN_FIT_CONTEXT, self.max_context // 2))
        if self.fit_limits and self.prefill_tokens > MIN_FIT_PREFILL:  # longer prompts then take more passes
            return replace(self, prefill_tokens=max(MIN_FIT_PREFILL, self.prefill_tokens // 2))
        if self.fit_limits and self.staging_buffers > 1:  # one read fewer ahead of the compute
            return replace(self, staging_buffers=1)
        return None

    @classmethod
    def from_options(cls, device_mem: Any = None, ram_mem: Any = None, quant: str = "none",
                     draft_quant: str = "none", offload_dir: Optional[str] = None, **rest: Any) -> "OffloadConfig":
        """From the user's options (sizes as text like "22GB"); bad input is a one-line OffspecError, and so
        is an offload dir that cannot be written (checked now, before any work: `writable_offload_dir`)."""
        config = cls(device_mem=parse_optional_size(device_mem, "device_mem"),
                     ram_mem=parse_optional_size(ram_mem, "ram_mem"), quant=quant, draft_quant=draft_quant,
                     offload_dir=Path(offload_dir).expanduser() if offload_dir else None, **rest).validate()
        if config.offload_dir is not None or config.device_mem is not None or config.ram_mem is not None:
            config.writable_offload_dir()  # layers may stream from it: fail now, not mid-load
        return config

    def writable_offload_dir(self) -> Path:
        """The directory of the packed layer files, checked writable (OffspecError otherwise)."""
        if self.offload_dir is not None:
            return check_writable_dir(self.offload_dir, "the offload dir", "pass a writable directory to "
                                      "--offload-dir (offload_dir= in Python)")
        return check_writable_dir(cache_dir() / "offload", "the default offload dir",
                                  "pass a writable directory to --offload-dir, or set OFFSPEC_CACHE_DIR")

    @classmethod
    def from_load_config(cls, load_cfg: Any) -> "OffloadConfig":
        return cls.from_options(load_cfg.device_mem, load_cfg.ram_mem, load_cfg.quant, load_cfg.draft_quant,
                                load_cfg.offload_dir, max_context=load_cfg.max_context,
                                max_budget=load_cfg.max_budget, stream_head=load_cfg.stream_head)

    def validate(self) -> "OffloadConfig":
        for name in ("quant", "draft_quant"):
            if getattr(self, name) not in QUANTS:
                raise OffspecError(f"unknown {name} {getattr(self, name)!r}; use none, int4, int8 or nf4")
        if self.ring_slots < 2:
            raise OffspecError(f"ring_slots must be >= 2 (one slot computes while the next loads), "
                               f"got {self.ring_slots}")
        if self.staging_buffers < 1:
            raise OffspecError(f"staging_buffers must be >= 1, got {self.staging_buffers}")
        if self.verify not in ("first", "always", "never"):
            raise OffspecError(f"verify must be first, always or never, got {self.verify!r}")
        if self.stream_head not in ("auto", "always", "never"):
            raise OffspecError(f"stream_head must be auto, always or never, got {self.stream_head!r}")
        return self
