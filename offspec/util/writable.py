"""Checking, before any work, that a directory offspec will write into can be written.

`check_writable_dir` walks up to the nearest existing ancestor and creates (then removes) a scratch
directory there, so read-only mounts, missing permissions, a file in the way and pseudo file systems such
as /proc are all caught up front, as one OffspecError line, without leaving anything behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from offspec.errors import OffspecError

_REASONS = {
    errno.EROFS: "is on a read-only file system",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (operation not permitted)",
    errno.ENOSPC: "is on a full disk",
    errno.EDQUOT: "is over its disk quota",
    errno.ENOENT: "does not accept new directories",  # e.g. /proc
}


def check_writable_dir(path: Path, what: str, fix: str) -> Path:
    """Raise OffspecError unless `path` is, or can be created as, a writable directory.

    `what` names it for the user ("the offload dir /x"), `fix` says what to do ("pass another --offload-dir").
    Returns the path. Nothing is created: the probe directory is removed again."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OffspecError(f"{what} {path} is a file, not a directory; {fix}")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise OffspecError(f"{what} {path} cannot be created: {existing} is a file, not a directory; {fix}")
    try:
        probe = tempfile.mkdtemp(prefix=".offspec-write-test-", dir=existing)
    except OSError as exc:
        reason = _REASONS.get(exc.errno, f"is not writable ({exc.strerror or exc})")
        place = f"{existing}" if existing == path else f"{existing} (where {path} would be created)"
        raise OffspecError(f"{what} {path} cannot be used: {place} {reason}; {fix}") from None
    os.rmdir(probe)
    return path
