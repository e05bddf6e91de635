"""The doctor's checks about the machine itself: the device, host->device copies, the SSD.

Each check returns a `Check`: passed, failed or skipped, with a one-line reason and its figures. Thresholds are
named here, with why: a failure means offspec will not work well there, not that the machine is slow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from offspec.errors import OffspecError
from offspec.offload.placement import default_budgets
from offspec.profile.hardware import disk_read_bandwidth, host_to_device
from offspec.util.device import default_dtype, device_name, free_memory
from offspec.util.sizes import format_size

PASS, FAIL, SKIP = "pass", "fail", "skip"
MIN_FREE_DEVICE = 10**9  # below 1 GB free there is no room for a draft, the caches and two streaming slots
MIN_PINNED = 2e9  # bytes/s: below PCIe 3.0 x4; a pinned copy this slow means a degraded link or no pinning
PINNED_OVER_PAGEABLE = 0.9  # pinned copies are normally ~2x pageable ones; slower means pinning is not working
MIN_DISK = 1e8  # bytes/s: below 100 MB/s (a network share, a USB stick) the SSD tier would take minutes a pass


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    reason: str  # one line
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status.upper():4}  {self.name}: {self.reason}"


def no_gpu_reason(device: torch.device) -> str:
    if not torch.backends.cuda.is_built():
        return "this torch has no CUDA support"
    return "no CUDA GPU is visible" if not torch.cuda.is_available() else f"--device is {device}"


def needs_cuda(name: str, device: torch.device) -> Check:
    return Check(name, SKIP, f"needs a CUDA GPU ({no_gpu_reason(device)})")


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """Run `check`; an error becomes a failed check with its first line (Ctrl-C still stops the doctor)."""
    try:
        return check()
    except OffspecError as exc:
        return Check(name, FAIL, str(exc))
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure as a line, never a traceback
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Check(name, FAIL, f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def device_check(device: torch.device, dtype: torch.dtype) -> Check:
    """The device, its free memory and compute capability, the dtype offspec computes in, the default budgets."""
    import psutil


    dtype_name = str(dtype).removeprefix("torch.")
    dev_budget, ram_budget = default_budgets(device)
    budgets = f"default budgets --device-mem {format_size(dev_budget)}, --ram-mem {format_size(ram_budget)}"
    if device.type != "cuda":
        available = psutil.virtual_memory().available
        return Check("device", PASS, f"{device}: {os.cpu_count()} CPU cores, {format_size(available)} RAM available, "
                     f"{dtype_name}; default --device-mem {format_size(dev_budget)} (on a CPU it caps offspec's "
                     f"memory; streamed layers come from SSD); no GPU: {no_gpu_reason(device)}",
                     {"device": str(device), "dtype": dtype_name, "ram_available": available,
                      "default_device_mem": dev_budget, "default_ram_mem": ram_budget})
    free, total = free_memory(device)
    capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    note = "" if dtype == default_dtype(device) else f" (asked for; the default here is " \
                                                      f"{str(default_dtype(device)).removeprefix('torch.')})"
    figures = {"device": str(device), "name": device_name(device), "free": free, "total": total,
               "capability": capability, "dtype": dtype_name, "default_device_mem": dev_budget,
               "default_ram_mem": ram_budget}
    text = (f"{device} {device_name(device)}: {format_size(free)} free of {format_size(total)}, compute capability "
            f"{capability}, {dtype_name}{note}; {budgets}")
    if free < MIN_FREE_DEVICE:
        return Check("device", FAIL, f"{text}: less than {format_size(MIN_FREE_DEVICE)} free, no room for the "
                                     f"draft, caches and streaming slots; close what uses the GPU", figures)
    return Check("device", PASS, text, figures)


def link_check(device: torch.device, nbytes: int) -> Check:
    """Pinned and pageable host->device copy bandwidth (the link the streamed layers cross)."""
    name = "host->device copies"
    if device.type != "cuda":
        return needs_cuda(name, device)
    pinned, pageable = host_to_device(device, nbytes, repeats=5)
    figures = {"pinned": pinned, "pageable": pageable, "bytes": nbytes}
    text = (f"{pinned / 1e9:.1f} GB/s pinned, {pageable / 1e9:.1f} GB/s pageable "
            f"({pinned / pageable:.1f}x; {format_size(nbytes)} copies)")
    if pinned < PINNED_OVER_PAGEABLE * pageable:
        return Check(name, FAIL, f"{text}: pinned copies are not faster than pageable ones, so pinning is not "
                                 f"working here (WSL and some containers limit it)", figures)
    if pinned < MIN_PINNED:
        return Check(name, FAIL, f"{text}: below {MIN_PINNED / 1e9:.0f} GB/s, the GPU's link is degraded (check "
                                 f"the PCIe slot and `nvidia-smi -q -d PCIE`)", figures)
    return Check(name, PASS, text, figures)


def disk_check(directory: Path, nbytes: int) -> Check:
    """Read speed of a fresh file in the offload directory, page cache bypassed (as the SSD tier reads)."""
    rate, how = disk_read_bandwidth(directory, nbytes)
    mode = "O_DIRECT" if how == "direct" else "buffered: this file system refuses O_DIRECT"
    figures = {"read": rate, "mode": how, "directory": str(directory), "bytes": nbytes}
    text = f"{rate / 1e9:.2f} GB/s reading {format_size(nbytes)} in {directory} ({mode})"
    if rate < MIN_DISK:
        return Check("SSD read", FAIL, f"{text}: below {MIN_DISK / 1e6:.0f} MB/s; put --offload-dir on a local "
                                       f"SSD or give more --ram-mem", figures)
    return Check("SSD read", PASS, text, figures)
