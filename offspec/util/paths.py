"""Where offspec keeps its files: the user directories of this system (platformdirs: the XDG base directories on
Linux, `~/.cache/offspec` and so on), each overridable by an environment variable (`OFFSPEC_CACHE_DIR`, ...).

Before platformdirs, offspec used the XDG directories on every system, so: an XDG variable that is set is
honoured everywhere, and where `~/.cache/offspec` (etc.) exists and the system's own directory does not (macOS,
Windows), it is still used: existing caches, profiles and chats are found.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "offspec"
_XDG = {"cache": ("XDG_CACHE_HOME", ".cache"), "config": ("XDG_CONFIG_HOME", ".config"),
        "data": ("XDG_DATA_HOME", ".local/share")}  # offspec's own XDG lookup before platformdirs


def _user_dir(override: str, kind: str) -> Path:
    if os.environ.get(override):
        return Path(os.environ[override]).expanduser()
    var, fallback = _XDG[kind]
    if os.environ.get(var):  # set: honoured on every system, "~" expanded, as offspec always did
        return Path(os.environ[var]).expanduser() / APP
    system = Path(getattr(platformdirs, f"user_{kind}_dir")(APP, appauthor=False)).expanduser()
    earlier = Path.home() / fallback / APP
    return earlier if earlier != system and earlier.is_dir() and not system.exists() else system


def cache_dir() -> Path:
    """Model assembly / conversion cache. `OFFSPEC_CACHE_DIR` overrides the user cache dir (Linux:
    `$XDG_CACHE_HOME/offspec`, by default `~/.cache/offspec`)."""
    return _user_dir("OFFSPEC_CACHE_DIR", "cache")


def kernels_dir() -> Path:
    """Compiled CPU kernels (keyed by a build id inside). `OFFSPEC_KERNELS_DIR` overrides `cache_dir()/kernels`."""
    override = os.environ.get("OFFSPEC_KERNELS_DIR")
    return Path(override).expanduser() if override else cache_dir() / "kernels"


def config_dir() -> Path:
    """Measured hardware profiles. `OFFSPEC_CONFIG_DIR` overrides the user config dir (Linux:
    `$XDG_CONFIG_HOME/offspec`, by default `~/.config/offspec`)."""
    return _user_dir("OFFSPEC_CONFIG_DIR", "config")


def data_dir() -> Path:
    """Chat history. `OFFSPEC_DATA_DIR` overrides the user data dir (Linux: `$XDG_DATA_HOME/offspec`, by default
    `~/.local/share/offspec`)."""
    return _user_dir("OFFSPEC_DATA_DIR", "data")
