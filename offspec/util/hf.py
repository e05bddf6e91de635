"""The Hugging Face side: the hub's environment read at call time (offline mode, cache, endpoint), and keeping
transformers and huggingface_hub quiet while offspec reports its own progress.

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HOME once, when it is imported; offspec reads them when it
acts, so a variable set after the import (a test, a long-lived process) still counts.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read at call time."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment at call time (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_endpoint() -> str:
    """The Hub's address: HF_ENDPOINT (a mirror, or a test server) at call time, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).strip().rstrip("/")


@contextmanager
def quiet_hub() -> Iterator[None]:
    """Silence huggingface_hub's progress bars, warnings and info logs (not transformers'); errors still raise."""
    # imported here, as in quiet_transformers: offspec.util stays importable without loading huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_bars_off = are_progress_bars_disabled()
    hub_logger.setLevel(logging.ERROR)
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_logger.setLevel(level)
        if not hub_bars_off:
            enable_progress_bars()


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' / huggingface_hub's progress bars, warnings and info logs; errors still raise."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with quiet_hub():
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
