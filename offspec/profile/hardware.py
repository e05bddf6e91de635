"""The machine: what it is (names, memory) and how fast it moves and multiplies numbers.

`identity()` is cheap and stable (it keys saved profiles); `measure_hardware()` times the offload dir's
read bandwidth (page cache bypassed), the device's memory bandwidth and matmul throughput, and on a GPU
the host->device copy bandwidth from pinned and from pageable memory.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.errors import OffspecError
from offspec.offload.diskio import read_at
from offspec.offload.hostmem import host_buffer
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.device import sync_compute
from offspec.util.paths import cache_dir
from offspec.util.files import remove_stale_temps, temp_path
from offspec.util.writable import check_writable_dir

CHUNK = 16 * 2**20  # bytes per disk read call
QUICK_DISK_BYTES, FULL_DISK_BYTES = 64 * 2**20, 512 * 2**20
QUICK_COPY_BYTES, FULL_COPY_BYTES = 64 * 2**20, 256 * 2**20


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def device_memory(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None  # the CPU computes from host RAM


def identity(device: torch.device) -> dict:
    """Stable facts that key a profile (memory rounded to whole GB, so small reservations don't matter)."""
    import psutil

    mem = device_memory(device)
    facts = {"device_type": device.type, "device_name": device_name(device),
             "device_memory_gb": round(mem / 1e9) if mem else None, "cpu": cpu_name(),
             "cpu_cores": os.cpu_count() or 1, "host_ram_gb": round(psutil.virtual_memory().total / 1e9)}
    if device.type == "cpu":
        facts["cpu_threads"] = torch.get_num_threads()  # OMP_NUM_THREADS=1 makes every pass cost differently
    return facts


def _best_time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync_compute(device)  # sync: timings must include the queued work (on the compute stream)
        t0 = time.perf_counter()
        fn()
        sync_compute(device)
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of a large copy within the device's memory (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)  # (n,)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), device, repeats)


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of a square (size x size) matmul in `dtype`."""
    a = torch.randn(size, size, device=device).to(dtype)  # (size, size)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _best_time(lambda: torch.mm(a, b), device, repeats)


def host_to_device(device: torch.device, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(pinned, pageable) host->device copy bandwidth in bytes/s (CUDA only). The pinned buffer is exactly
    `nbytes` page-locked (offspec.offload.hostmem, as the streamer's buffers) and unpinned on return."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)  # (nbytes,)
    pinned = host_buffer(nbytes, pin=True, device=device).fill_(1)  # (nbytes,) page-locked
    pageable = torch.ones(nbytes, dtype=torch.uint8)  # (nbytes,) ordinary memory, pages touched
    # wall clock around the copy and a sync of the stream it runs on (dst's device's current stream)
    t_pinned = _best_time(lambda: dst.copy_(pinned, non_blocking=True), device, repeats)
    t_pageable = _best_time(lambda: dst.copy_(pageable), device, repeats)
    return nbytes / t_pinned, nbytes / t_pageable


def disk_read_bandwidth(directory: Path, nbytes: int, progress: ProgressFn = no_progress) -> tuple[float, str]:
    """Sequential read bandwidth of a fresh file in `directory`, page cache bypassed: (bytes/s, how).

    The file is written, flushed and dropped from the page cache, then read with O_DIRECT into an
    aligned buffer (or buffered after posix_fadvise(DONTNEED) where O_DIRECT is refused); then removed.
    """
    check_writable_dir(directory, "the directory whose disk is measured", "pass a writable --offload-dir, "
                       "or set OFFSPEC_CACHE_DIR")
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(directory, legacy=(".offspec-readtest-*.bin",))  # left by runs that were killed
    path = temp_path(directory / "offspec-readtest.bin")  # a scratch file, removed below
    block = os.urandom(CHUNK)
    nbytes = max(CHUNK, nbytes // CHUNK * CHUNK)
    try:
        with open(path, "wb") as f:
            for i in range(nbytes // CHUNK):
                f.write(block)
                progress(ProgressEvent("disk", "disk read: writing a test file", (i + 1) * CHUNK, 2 * nbytes))
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
        how = "direct"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            how, fd = "buffered", os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop the pages the write left cached
            t0 = time.perf_counter()
            done = 0
            while done < nbytes:
                try:
                    n = read_at(fd, memoryview(buf), done)
                except OSError:  # O_DIRECT refused by this file system: buffered, cache already dropped
                    if how != "direct":
                        raise
                    os.close(fd)
                    how, fd = "buffered", os.open(path, os.O_RDONLY)
                    continue
                if n <= 0:
                    break
                done += n
                progress(ProgressEvent("disk", "disk read: reading it back", nbytes + done, 2 * nbytes))
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
            buf.close()
        return done / seconds, how
    except OSError as exc:  # e.g. a full disk while writing the test file
        raise OffspecError(f"cannot measure the disk read speed in {directory}: {exc.strerror or exc}; free "
                           f"{nbytes // 2**20} MB there or pass another --offload-dir") from None
    finally:
        path.unlink(missing_ok=True)
        progress(ProgressEvent("disk", "disk read", 2 * nbytes, 2 * nbytes, finished=True))


def measure_hardware(device: torch.device, dtype: torch.dtype, offload_dir: Optional[Path] = None,
                     quick: bool = False, progress: ProgressFn = no_progress) -> dict:
    """The `hardware` section of a profile (see offspec/profile/schema.py)."""
    import psutil

    copy_bytes = QUICK_COPY_BYTES if quick else FULL_COPY_BYTES
    steps = ["memory bandwidth", "matmul throughput"] + (["host->device copies"] if device.type == "cuda" else [])
    out = {"device_type": device.type, "device_name": device_name(device), "device_memory_bytes": device_memory(device),
           "host_ram_bytes": int(psutil.virtual_memory().total), "cpu": cpu_name(), "cpu_cores": os.cpu_count() or 1}
    for i, step in enumerate(steps):
        progress(ProgressEvent("hardware", f"hardware: {step}", i, len(steps)))
        if step == "memory bandwidth":
            out["device_memory_bandwidth"] = memory_bandwidth(device, copy_bytes)
            if device.type == "cuda":
                out["host_memory_bandwidth"] = memory_bandwidth(torch.device("cpu"), copy_bytes)
            else:
                out["host_memory_bandwidth"] = out["device_memory_bandwidth"]
        elif step == "matmul throughput":
            out["device_flops"] = matmul_flops(device, dtype, 1024 if quick or device.type == "cpu" else 4096)
        else:
            out["h2d_pinned_bytes_per_s"], out["h2d_pageable_bytes_per_s"] = host_to_device(device, copy_bytes)
    progress(ProgressEvent("hardware", "hardware", len(steps), len(steps), finished=True))
    if device.type != "cuda":
        out["h2d_pinned_bytes_per_s"] = out["h2d_pageable_bytes_per_s"] = None
    directory = Path(offload_dir).expanduser() if offload_dir else cache_dir() / "offload"
    out["disk_read_bytes_per_s"], _how = disk_read_bandwidth(directory, QUICK_DISK_BYTES if quick else FULL_DISK_BYTES,
                                                             progress)
    return out
