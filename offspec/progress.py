"""Progress reporting for long work (assembling, converting, loading, warm-up).

The runtime never prints: it calls a `ProgressFn` with `ProgressEvent`s, and the CLI or the TUI renders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class ProgressEvent:
    step: str  # short machine name: "download", "assemble", "verify", "convert", "load", "kernels", "warmup"
    message: str  # human text, e.g. "assembling target weights"
    done: float = 0.0  # units done so far (bytes, layers, ...)
    total: Optional[float] = None  # None when unknown
    finished: bool = False  # True on the last event of a step


ProgressFn = Callable[[ProgressEvent], None]


def no_progress(event: ProgressEvent) -> None:
    """The default: report nothing."""
