"""Reading packed layer files from SSD into aligned host buffers, bypassing the page cache.

O_DIRECT reads go straight from the disk into the (page-aligned) buffer: no page-cache copy, and the
file never fills RAM behind the budget's back. Where O_DIRECT is refused (tmpfs, some network and FUSE file
systems: EINVAL, EOPNOTSUPP/ENOTSUP, or EFAULT for a buffer the driver cannot DMA into) or does not exist
(macOS, Windows), reads are buffered and followed by posix_fadvise(DONTNEED), which drops the file's cached
pages, where that exists. Where `os.preadv` does not exist (Windows), plain file reads into the buffer are used.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Optional

import torch

from .hostmem import PAGE, host_buffer

ALIGN = 4096  # O_DIRECT buffer address, offset and size alignment
CHUNK = 16 * 2**20  # bytes per read call
# what open()/read() answer where a file system or a buffer cannot do O_DIRECT: fall back to buffered reads
DIRECT_REFUSED = frozenset(e for e in (errno.EINVAL, getattr(errno, "EOPNOTSUPP", None),
                                       getattr(errno, "ENOTSUP", None), errno.EFAULT) if e is not None)
BUFFERED = "buffered+dontneed" if hasattr(os, "posix_fadvise") else "buffered"


def aligned_empty(nbytes: int, pin: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """(nbytes,) uint8 host buffer whose address is page-aligned (so 4 KiB-aligned for O_DIRECT); pinned for
    CUDA `device` (None: the current one) when `pin`. See hostmem.host_buffer: exact pages, unpinned when freed."""
    assert PAGE % ALIGN == 0
    return host_buffer(nbytes, pin=pin, device=device)


def read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read up to len(view) bytes at `offset` of `fd` into `view`; returns the bytes read (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)  # one syscall, releases the GIL
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no preadv/pread; a positioned raw read instead
    with open(fd, "rb", buffering=0, closefd=False) as f:
        return f.readinto(view) or 0


class FileReader:
    """Whole-file reads into host buffers; `mode` says how ("direct", "buffered+dontneed" or "buffered")."""

    def __init__(self, direct: bool = True):
        self.mode = "direct" if direct and hasattr(os, "O_DIRECT") else BUFFERED

    def read(self, path: os.PathLike, into: torch.Tensor, nbytes: int, offset: int = 0) -> float:
        """Read `nbytes` of `path` from `offset` (both multiples of 4 KiB) into `into`; returns the seconds spent."""
        t0 = time.perf_counter()
        view = memoryview(into.numpy())[:nbytes]  # writable view of the buffer; no copy
        if self.mode == "direct":
            try:
                self._read(path, view, os.O_DIRECT, offset)
                return time.perf_counter() - t0
            except OSError as exc:
                if exc.errno not in DIRECT_REFUSED:
                    raise
                self.mode = BUFFERED  # this file system (or this buffer) refuses O_DIRECT
        self._read(path, view, 0, offset)
        return time.perf_counter() - t0

    def probe(self, path: os.PathLike) -> str:
        """Settle the read mode on `path`'s file system with a 4 KiB read; returns the mode."""
        self.read(path, aligned_empty(ALIGN), ALIGN)
        return self.mode

    def _read(self, path: os.PathLike, view: memoryview, flags: int, offset: int = 0) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | flags)
        try:
            done = 0
            while done < len(view):
                n = read_at(fd, view[done : done + CHUNK], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"{path} is shorter than expected ({done} of {len(view)} bytes)")
                done += n
            if not flags and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)  # drop the pages this read cached
        finally:
            os.close(fd)
