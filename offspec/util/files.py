"""Writing files so that nothing is left half-written, the temps of runs that died, and hashing files.

Every file offspec writes goes to a temp name beside it and is renamed into place (`atomic_write`); a directory
is built under a temp name and renamed the same way (`temp_path`). A temp's name carries the id of the process
that writes it, `.<name>.tmp-<pid>-<random>` (`.<name>.trash-<pid>-<random>` for a tree being removed): an
interrupted write removes its own temp, and a process killed outright (SIGKILL, a crash, power loss) leaves one
that the next run removes once that process is gone (`remove_stale_temps`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import IO, Callable, Optional, Union

from offspec.progress import ProgressEvent, ProgressFn, no_progress

BLOCK = 8 * 1024 * 1024  # read / hash block size
TEMP_KINDS = ("tmp", "trash")
# `.<name>.<kind>-<pid>-<random hex>`: the pid says whether its writer still runs
_TEMP = re.compile(r"^\..+\.(?:tmp|trash)-(?P<pid>\d+)-[0-9a-f]+$")
STALE_SECONDS = 600  # an untagged temp of an older offspec (`legacy` patterns) untouched this long is dead


def temp_path(path: Path, kind: str = "tmp") -> Path:
    """The temp name of `path`, beside it: `.<name>.tmp-<pid>-<random>` (kind "trash": a tree being removed)."""
    if kind not in TEMP_KINDS:
        raise ValueError(f"kind must be one of {TEMP_KINDS}, got {kind!r}")
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: Path, data: Union[str, bytes, Callable[[IO], None]], *, fsync: bool = True,
                 encoding: Optional[str] = None) -> Path:
    """Write `data` to `path` through a temp file in the same directory, renamed into place: `path` holds either
    its old content or the whole new one, never a part. `data`: text (written as UTF-8), bytes, or a function that
    writes to the open temp file (binary, opened for reading too; text when an `encoding` is given). `fsync`: the
    data reaches the disk before the rename (a power loss then leaves the old file or the new one). Any error,
    Ctrl-C included, removes the temp and is raised as it is. Returns `path`."""
    path = Path(path)
    tmp = temp_path(path)
    if isinstance(data, str):
        encoding = encoding or "utf-8"
    text = encoding is not None
    try:
        with open(tmp, "w+" if text else "wb+", **({"encoding": encoding} if text else {})) as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else; anything else: cannot tell, so alive
        return True
    return True


def remove_stale_temps(directory: Path, legacy: tuple[str, ...] = ()) -> list[Path]:
    """Remove the temps in `directory` (files or trees, `temp_path` names) whose process is gone; this process's
    own and those of live processes are left alone. `legacy`: glob patterns of untagged temps older offspec
    versions wrote, removed once untouched for STALE_SECONDS. Returns what was removed; a temp that cannot be
    removed is left for a later run (it is only a temp)."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    now = time.time()
    old = {p for pattern in legacy for p in Path(directory).glob(pattern)}
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match is not None:
            pid = int(match["pid"])
            if pid == os.getpid() or pid_alive(pid):
                continue
        elif entry in old:
            try:
                if now - entry.stat().st_mtime <= STALE_SECONDS:
                    continue  # possibly still written by a live run
            except OSError:
                continue
        else:
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed


def sha256_file(path: Path, *, progress: ProgressFn = no_progress, step: str = "verify", message: str = "") -> str:
    """Hex sha256 of a file, read in blocks; `progress` hears the bytes hashed (and a finished event)."""
    total = Path(path).stat().st_size
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
            done += len(block)
            progress(ProgressEvent(step, message, done, total))
    progress(ProgressEvent(step, message, done, total, finished=True))
    return digest.hexdigest()
