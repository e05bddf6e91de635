"""`offspec doctor`: what offspec will do on this machine, and whether its GPU paths work here.

- checks.py     the device (free memory, compute capability, dtype, default budgets), host->device copies
                (pinned and pageable), the SSD read speed
- kernels.py    offspec's Triton kernels launch on this GPU (every tiling of the usual weight types)
- overlap.py    copy/compute overlap through the real layer streamer, at the model's layer size
- logits.py     streamed logits == resident logits on a small random model
- streaming.py  the last two as pass/fail checks
- cli.py        the command: runs every check, one line each; exit 1 when one fails

Checks that need CUDA are skipped, with the reason, on a machine without it. `pytest -m cuda` runs the same
checks as tests (tests/test_cuda.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.progress import no_progress

from .checks import FAIL, PASS, SKIP, Check, device_check, disk_check, guarded, link_check
from .kernels import kernels_check
from .streaming import layer_size, logits_check, overlap_check

__all__ = ["Check", "PASS", "FAIL", "SKIP", "run_checks"]


def run_checks(device: torch.device, dtype: torch.dtype, offload_dir: Path, target: Optional[str] = None,
               quick: bool = False, on_start: Callable[[str], None] = lambda name: None,
               on_done: Callable[[Check], None] = lambda check: None, progress=None) -> list[Check]:
    """Every check in turn; `on_start(name)` before and `on_done(check)` after each (the CLI prints them)."""
    progress = progress or no_progress
    copy_bytes = (64 if quick else 256) * 2**20
    results: list[Check] = []

    def run(name: str, fn) -> Check:
        on_start(name)
        check = guarded(name, fn)
        results.append(check)
        on_done(check)
        return check

    run("device", lambda: device_check(device, dtype))
    run("CUDA kernels", lambda: kernels_check(device, dtype, quick))
    link = run("host->device copies", lambda: link_check(device, copy_bytes))
    run("SSD read", lambda: disk_check(offload_dir, copy_bytes))
    pinned = link.figures.get("pinned") if link.status == PASS else None

    def overlap() -> Check:
        if device.type != "cuda":
            return overlap_check(device, dtype, 0, "", None, quick)  # skipped: says why
        nbytes, what = layer_size(target, dtype, progress)
        return overlap_check(device, dtype, nbytes, what, pinned, quick)

    run("copy/compute overlap", overlap)
    run("streamed == resident", lambda: logits_check(device, dtype))
    return results
