"""Reading packed layer files from SSD into aligned host buffers, bypassing the page cache.

O_DIRECT reads go straight from the disk into the (4 KiB-aligned) buffer: no page-cache copy, and the
file never fills RAM behind the budget's back. Where O_DIRECT is refused (tmpfs, some network file
systems), reads are buffered and followed by posix_fadvise(DONTNEED), which drops the file's cached pages.
"""

from __future__ import annotations

import errno
import os
import time

import torch

ALIGN = 4096  # O_DIRECT buffer address, offset and size alignment
CHUNK = 16 * 2**20  # bytes per read call


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """(nbytes,) uint8 host buffer whose address is 4 KiB-aligned; pinned (page-locked) when `pin` (CUDA only)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)  # (nbytes + 4096,)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]  # the view keeps `raw` alive


class FileReader:
    """Whole-file reads into host buffers; `mode` says how ("direct" or "buffered+dontneed")."""

    def __init__(self, direct: bool = True):
        self.mode = "direct" if direct and hasattr(os, "O_DIRECT") else "buffered+dontneed"

    def read(self, path: os.PathLike, into: torch.Tensor, nbytes: int) -> float:
        """Read the first `nbytes` (a multiple of 4 KiB) of `path` into `into`; returns the seconds spent."""
        t0 = time.perf_counter()
        view = memoryview(into.numpy())[:nbytes]  # writable view of the buffer; no copy
        if self.mode == "direct":
            try:
                self._read(path, view, os.O_DIRECT)
                return time.perf_counter() - t0
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.mode = "buffered+dontneed"  # this file system refuses O_DIRECT
        self._read(path, view, 0)
        return time.perf_counter() - t0

    def probe(self, path: os.PathLike) -> str:
        """Settle the read mode on `path`'s file system with a 4 KiB read; returns the mode."""
        self.read(path, aligned_empty(ALIGN), ALIGN)
        return self.mode

    def _read(self, path: os.PathLike, view: memoryview, flags: int) -> None:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done : done + CHUNK]], done)  # releases the GIL
                if n <= 0:
                    raise OSError(errno.EIO, f"{path} is shorter than expected ({done} of {len(view)} bytes)")
                done += n
            if not flags and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop the pages this read cached
        finally:
            os.close(fd)
