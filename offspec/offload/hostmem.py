"""Host buffers for streaming: page-aligned, sized to the page, and page-locked ("pinned") on CUDA by
registering them with the driver (cudaHostRegister) rather than through PyTorch's pinned allocator.

Why not `torch.empty(..., pin_memory=True)`: PyTorch's caching host allocator rounds every block up to a power
of two (a 1.71 GB layer pins 2.15 GB, a 0.27 GB one 0.54 GB) and keeps freed blocks pinned for later reuse.
Here a buffer is one anonymous mapping of exactly its pages: it pins those pages and nothing else, and the
pages are unpinned and returned to the OS as soon as the last tensor viewing them is gone (a finalizer on
the storage, which runs before the mapping is released).

A failed registration (the OS would not lock that much memory) is a one-line OffspecError.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import threading
import weakref
from typing import Optional

import torch

from offspec.errors import OffspecError
from offspec.util.sizes import format_size, parse_size

PAGE = max(mmap.PAGESIZE, 4096)  # O_DIRECT needs 4 KiB alignment; mappings are page-aligned
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process

_lock = threading.Lock()
_pinned = [0]  # bytes registered now, by this module


def page_round(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages: what a host buffer of that size really takes (and pins)."""
    return max(PAGE, -(-int(nbytes) // PAGE) * PAGE)


def pinned_bytes() -> int:
    """Host bytes this process holds pinned through `host_buffer` right now."""
    return _pinned[0]


def host_buffer(nbytes: int, pin: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """A (nbytes,) uint8 host tensor whose address is page-aligned; pinned for `device` (a CUDA device) when `pin`.

    Views of it keep the memory alive; when the last one goes, the pages are unpinned and unmapped."""
    size = page_round(nbytes)
    mapping = mmap.mmap(-1, size)  # anonymous, page-aligned, zero pages until touched
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # (size,) the storage keeps the mapping alive
    del mapping
    if pin:
        _register(raw, device)
    return raw[:nbytes]


# --- registration (CUDA) ---------------------------------------------------------------------------------
def _runtime():
    """The CUDA runtime calls used here (a seam for tests on machines without CUDA)."""
    return torch.cuda.cudart()


def _on_device(device: Optional[torch.device]):
    """Make `device` current for a runtime call, so that no context is created on another GPU."""
    if device is None or device.index is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _error_text(code: int) -> str:
    try:
        return f"{torch.cuda.CudaError(code)} (CUDA error {code})"
    except Exception:  # noqa: BLE001 - only the text of an error we are already reporting
        return f"CUDA error {code}"


def _register(raw: torch.Tensor, device: Optional[torch.device]) -> None:
    ptr, size = raw.data_ptr(), raw.numel()
    with _on_device(device):
        code = int(_runtime().cudaHostRegister(ptr, size, HOST_REGISTER_PORTABLE))
    if code != 0:
        raise OffspecError(f"cannot pin {format_size(size)} of host RAM for streaming ({_error_text(code)}; "
                           f"{format_size(pinned_bytes())} pinned already); lower --ram-mem or free some RAM")
    with _lock:
        _pinned[0] += size
    # runs when the storage dies, before its mapping is released (the storage holds the mapping)
    finalizer = weakref.finalize(raw.untyped_storage(), _unregister, ptr, size, device)
    finalizer.atexit = False  # at interpreter exit the process is going anyway; do not call into CUDA then


def _unregister(ptr: int, size: int, device: Optional[torch.device]) -> None:
    with _lock:
        _pinned[0] -= size
    try:
        with _on_device(device):
            _runtime().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the mapping is released either way
        pass


_measured: list[Optional[int]] = [None]  # the first measurement of runtime_bytes


def runtime_bytes(exclude: int = 0) -> int:
    """The runtime's own memory, which a CPU device's budget holds beside the models: the process's anonymous
    memory (Linux: RssAnon; elsewhere its resident set) when the first model of the process is placed (Python,
    torch, transformers, a tokenizer). Measured once, so that every later placement in the process (a reload, a
    benchmark's second set-up, a suggested --device-mem tried again) charges the same. `exclude`: bytes of that
    memory already charged as a model's (a draft loaded into memory rather than mapped from its store).
    OFFSPEC_RUNTIME_MEM (a size, e.g. 400MB or 0) replaces the measurement: a process that holds much else
    (a notebook's data) would otherwise charge all of it to the models' budget."""
    import os

    given = os.environ.get("OFFSPEC_RUNTIME_MEM")
    if given:
        return parse_size(given, "OFFSPEC_RUNTIME_MEM")
    if _measured[0] is None:
        _measured[0] = max(0, measure_anonymous() - exclude)
    return _measured[0]


def measure_anonymous() -> int:
    """The process's anonymous memory now (Linux: RssAnon; elsewhere its resident set, an over-estimate)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.Process().memory_info().rss)


M_MMAP_THRESHOLD = -3  # glibc mallopt(3) parameter
HEAP_MMAP_THRESHOLD = 4 << 20  # see bound_heap


def trim_heap(collect: bool = True) -> None:
    """Give freed heap memory back to the OS (glibc keeps mid-sized frees, e.g. packing's per-tensor buffers, and
    the freed middle of the heap: a pass's activations, whose sizes vary with the tree and the context); objects in
    reference cycles (a dropped tokenizer's, a model build's) are collected first where `collect`: a full collection
    walks every object of the process (0.2-0.4 s with torch and transformers imported, more in a long-lived one),
    so loads do it only under a CPU budget, which holds the whole process."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=None)
def _libc():
    """glibc, or None (another C library, another system)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def bound_heap() -> bool:
    """glibc: every allocation of HEAP_MMAP_THRESHOLD or more gets a mapping of its own, unmapped when freed; returns
    whether the setting took. By default the threshold rises to the largest block freed so far (up to 32 MB): once a
    prefill's or a big tree's activations are freed, blocks that size come from the heap, whose freed middle the
    process keeps. A CPU budget holds the whole process, and under `--device-mem 1GB` those blocks held 10-40 MB
    (noisy from run to run) beyond the budget's activations. Decoding's per-layer blocks are smaller than the
    threshold: they stay in the heap, reused without page faults. Process-wide, set once a CPU budget is planned;
    elsewhere (not glibc) nothing."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # a libc without mallopt (musl)
        return False


MADV_RANDOM, MADV_DONTNEED = 1, 4  # Linux madvise(2) advice


def advise(view: torch.Tensor, advice: int) -> None:
    """madvise(2) over the whole pages of a memory-mapped host view (Linux; elsewhere nothing). Advice only: a
    refusal changes what stays cached, never a value. MADV_RANDOM: a fault reads its page alone, not the 128 KiB
    around it (a token table whose rows are looked up here and there). MADV_DONTNEED: the pages go, and the next
    read of one reads the file again; only for a mapping nothing wrote (a written copy-on-write page would be lost):
    a draft's full LM head, kept mapped to admit tokens later, whose rows were all read once for its reduced head."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or view.device.type != "cpu" or view.numel() == 0:
        return
    start = view.data_ptr()
    first = start // PAGE * PAGE if advice == MADV_RANDOM else -(-start // PAGE) * PAGE  # DONTNEED: inside only
    end = (start + view.numel() * view.element_size()) // PAGE * PAGE
    if end > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), advice)


def drop_cached(path) -> None:
    """Drop `path`'s cached pages that no mapping uses (a benchmark's cold start: `offspec bench offload`). Loading
    never does: the page cache is the OS's to reclaim (a memory cgroup reclaims it before it would kill), and the
    next start would read those files and libraries from the disk again."""
    import os

    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # mapped pages stay: only unused copies go
    finally:
        os.close(fd)
