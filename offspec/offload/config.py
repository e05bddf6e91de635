"""Offloading settings: the OffloadConfig dataclass (offspec.config, with every default), how the user's option
values become its fields, and the constants of this machine's memory that placement assumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offspec.config import MIN_FIT_BUDGET, MIN_FIT_CONTEXT, MIN_FIT_PREFILL, RING_SLOTS, STAGING_BUFFERS, OffloadConfig
from offspec.util.paths import cache_dir
from offspec.util.sizes import parse_size
from offspec.util.writable import check_writable_dir

__all__ = ["OffloadConfig", "read_options", "offload_config", "checked_offload_dir", "writable_offload_dir",
           "RING_SLOTS", "STAGING_BUFFERS", "MIN_FIT_BUDGET", "MIN_FIT_CONTEXT", "MIN_FIT_PREFILL", "FREE_FRACTION",
           "WORKSPACE", "CPU_HEADROOM", "HOST_RESERVE", "ASSUMED_BANDWIDTH"]

FREE_FRACTION = 0.92  # share of the free device memory (or available RAM) a default budget takes
# device memory offspec uses beyond its tensors (allocator slack, kernel workspaces, Python objects; on CUDA
# also the context): charged to the device budget with the resident parts
WORKSPACE = {"cuda": 512 * 2**20, "cpu": 48 * 2**20}
# share of a CPU budget given (--device-mem, which holds the whole process) that the plan leaves free: the peak RSS
# also holds what the runtime measure at load misses (library pages mapped later, short-lived allocations, heap
# fragments), and another machine's runtime may be larger than this one's (issue 63: 1 GB at most 950 MB)
CPU_HEADROOM = 0.07
HOST_RESERVE = 2 * 10**9  # RAM left to the OS and everything else when the host RAM budget defaults
# Assumed speeds for the *predicted* pass time of the placement summary (`offspec bench offload` measures them).
ASSUMED_BANDWIDTH = {  # bytes/s
    "cuda": {"link": 20e9, "disk": 2e9, "memory": 1.5e12},  # PCIe 4 x16 pinned copies, NVMe, HBM
    "cpu": {"link": 8e9, "disk": 1e9, "memory": 12e9},  # memcpy into slots, SSD, DRAM
}

SIZE_OPTIONS = ("device_mem", "ram_mem")  # OffloadConfig fields given as sizes: "22GB", "512MiB" or bytes


def read_options(options: dict[str, Any]) -> dict[str, Any]:
    """The user's option values (`offspec.load`'s keywords, the CLI's flags) as OffloadConfig holds them: sizes in
    bytes (bad text is a one-line OffspecError naming the option), the offload dir as a Path."""
    read = dict(options)
    for name in SIZE_OPTIONS:
        if read.get(name) is not None:
            read[name] = parse_size(read[name], name)
    if read.get("offload_dir"):
        read["offload_dir"] = Path(read["offload_dir"]).expanduser()
    elif "offload_dir" in read:
        read["offload_dir"] = None
    return read


def offload_config(**options: Any) -> OffloadConfig:
    """An OffloadConfig from the user's option values (sizes as text like "22GB"); bad input is a one-line
    OffspecError, and so is an offload dir that cannot be written (`checked_offload_dir`)."""
    return checked_offload_dir(OffloadConfig(**read_options(options)).validate())


def checked_offload_dir(config: OffloadConfig) -> OffloadConfig:
    """`config`, after checking that its offload dir can be written where layers may stream from it (a dir or a
    budget was given): fail now, not mid-load."""
    if config.offload_dir is not None or config.device_mem is not None or config.ram_mem is not None:
        writable_offload_dir(config)
    return config


def writable_offload_dir(config: OffloadConfig) -> Path:
    """The directory of the packed layer files, checked writable (OffspecError otherwise)."""
    if config.offload_dir is not None:
        return check_writable_dir(config.offload_dir, "the offload dir", "pass a writable directory to "
                                  "--offload-dir (offload_dir= in Python)")
    return check_writable_dir(cache_dir() / "offload", "the default offload dir",
                              "pass a writable directory to --offload-dir, or set OFFSPEC_CACHE_DIR")
