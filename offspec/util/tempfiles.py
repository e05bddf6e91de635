"""Temp files and directories tagged with the process that writes them, and removing those left behind.

offspec writes to a temp name and renames into place, and removes the temp when it is interrupted. A
process killed outright (SIGKILL, a crash, power loss) cannot: its temps carry its pid in their name, and
the next run removes those whose process is gone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def remove_stale_temps(directory: Path, prefix: str, suffix: str = "") -> list[Path]:
    """Remove `<prefix><pid><suffix>` entries of `directory` (files or directories) whose process is gone.

    Entries whose middle part is not a pid, or whose process still runs, are left alone. Returns what was
    removed; a temp that cannot be removed is left for a later run (it is only a temp)."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(suffix)) or len(name) <= len(prefix) + len(suffix):
            continue
        pid = name[len(prefix):len(name) - len(suffix)]
        if not pid.isdigit() or pid_alive(int(pid)):
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
