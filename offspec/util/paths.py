"""Where offspec keeps its files (XDG base directories, each overridable by an environment variable)."""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(env_override: str, xdg_var: str, fallback: str) -> Path:
    if os.environ.get(env_override):
        return Path(os.environ[env_override]).expanduser()
    base = os.environ.get(xdg_var) or str(Path.home() / fallback)
    return Path(base).expanduser() / "offspec"


def cache_dir() -> Path:
    """Model assembly / conversion cache. `OFFSPEC_CACHE_DIR` overrides `$XDG_CACHE_HOME/offspec`."""
    return _xdg("OFFSPEC_CACHE_DIR", "XDG_CACHE_HOME", ".cache")


def kernels_dir() -> Path:
    """Compiled CPU kernels (keyed by a build id inside). `OFFSPEC_KERNELS_DIR` overrides `cache_dir()/kernels`."""
    override = os.environ.get("OFFSPEC_KERNELS_DIR")
    return Path(override).expanduser() if override else cache_dir() / "kernels"


def config_dir() -> Path:
    """Measured hardware profiles. `OFFSPEC_CONFIG_DIR` overrides `$XDG_CONFIG_HOME/offspec`."""
    return _xdg("OFFSPEC_CONFIG_DIR", "XDG_CONFIG_HOME", ".config")


def data_dir() -> Path:
    """Chat history. `OFFSPEC_DATA_DIR` overrides `$XDG_DATA_HOME/offspec`."""
    return _xdg("OFFSPEC_DATA_DIR", "XDG_DATA_HOME", ".local/share")
