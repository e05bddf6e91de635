"""Keeping transformers and huggingface_hub quiet while offspec reports its own progress."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' / huggingface_hub's progress bars, warnings and info logs; errors still raise."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hub_bars_off = are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()
