"""The compiled CPU kernels' builds in the cache dir: one directory per sources, flags, torch and checkout
(kernels.py `_build_id`), 2-3 MB each, so every upgrade of offspec or torch leaves one behind.

Every load stamps its build as used (the marker file's time). A new build removes the builds no load has used for
STALE_DAYS: an older version's kernels, a deleted checkout's, a torch long gone. Builds still in use (a second
checkout, the AVX2 variant a user switches to now and then) keep their stamp fresh and stay.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PREFIX = "ggml-cpu-"  # a build directory's name: this prefix and the build id
MARKER = "built"  # written when a build completes; its time is the build's last use
STALE_DAYS = 30


def mark_used(directory: Path) -> None:
    """Stamp the build in `directory` as used now."""
    try:
        os.utime(directory / MARKER)
    except OSError:  # a read-only cache: the build cannot be stamped, and this process prunes nothing there either
        pass


def last_used(directory: Path) -> float:
    """When the build was last loaded: its marker's time, or the directory's for a build that never finished."""
    marker = directory / MARKER
    return (marker if marker.exists() else directory).stat().st_mtime


def stale_builds(root: Path, keep: Path, now: Optional[float] = None, days: float = STALE_DAYS) -> list[Path]:
    """The build directories under `root`, but `keep`, that no load has used for `days`."""
    now = time.time() if now is None else now
    found = []
    for directory in sorted(root.glob(PREFIX + "*")):
        if not directory.is_dir() or directory.resolve() == keep.resolve():
            continue
        try:
            if now - last_used(directory) > days * 86400:
                found.append(directory)
        except OSError:  # removed by another process meanwhile
            continue
    return found


@dataclass(frozen=True)
class Pruned:
    removed: int = 0
    freed_bytes: int = 0
    failed: int = 0  # builds that could not be removed (permissions): left as they are
    failure: str = ""  # the first one's reason

    def message(self) -> str:
        text = (f"removed {self.removed} CPU kernel build(s) unused for {STALE_DAYS} days "
                f"({self.freed_bytes / 1e6:.0f} MB)")
        if self.failed:
            text += f"; {self.failed} could not be removed ({self.failure})"
        return text


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and not f.is_symlink())


def prune_stale_builds(root: Path, keep: Path, now: Optional[float] = None) -> Pruned:
    """Remove the builds under `root` (not `keep`) unused for STALE_DAYS."""
    removed = freed = failed = 0
    failure = ""
    for directory in stale_builds(root, keep, now):
        try:
            size = _size(directory)
            shutil.rmtree(directory)
        except OSError as exc:
            failed += 1
            failure = failure or f"{directory.name}: {exc.strerror or exc}"
            continue
        removed += 1
        freed += size
    return Pruned(removed, freed, failed, failure)
