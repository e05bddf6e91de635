"""Which compute runs low-bit weights on CUDA, and the device memory it takes (no Triton import: a CPU never
loads it). Whether offspec's CUDA decoder layers can run a model: support.py.

`OFFSPEC_CUDA_KERNELS`: `auto` (the default) runs offspec's Triton kernels (linear.py, layer.py) where Triton is
installed and the torch decode path (dequant.py, then cuBLAS) where it is not; `triton` insists on Triton (a
one-line error without it); `torch` keeps the torch path (an A/B switch for measurements).

`fall_back(reason)`: the kernels cannot run on this card (probe.py found a configuration Triton cannot compile or
launch there): under `auto`, this process keeps the torch path from then on, and `fallback()` says why; under
`triton`, it is a one-line error.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

from offspec.errors import OffspecError


VARIABLE = "OFFSPEC_CUDA_KERNELS"
CHOICES = ("auto", "triton", "torch")
# device memory of the linears' float32 split partials (at most GRID_SPLIT_ROWS x ~2 x SMs x 64 columns: a few MB;
# every type decodes in the kernel's registers, with no scratch): the placement charges it on CUDA
WORKSPACE_BYTES = 16 * 2**20


_fallback: Optional[str] = None  # why this process fell back to the torch path (fall_back), None while it has not


def cuda_kernels() -> str:
    """"triton" or "torch": what computes low-bit weights on CUDA, as `OFFSPEC_CUDA_KERNELS`, Triton and the card
    allow."""
    choice = _choice(os.environ.get(VARIABLE, ""), importlib.util.find_spec("triton") is not None)
    return "torch" if _fallback is not None else choice


def fall_back(reason: str) -> str:
    """Keep the torch path for the rest of this process because offspec's Triton kernels cannot run here
    (`reason`: one line); returns the line to show. `OFFSPEC_CUDA_KERNELS=triton` makes it an error instead."""
    global _fallback
    if os.environ.get(VARIABLE, "").strip().lower() == "triton":
        raise OffspecError(f"{VARIABLE}=triton, but offspec's Triton kernels cannot run on this GPU: {reason}; "
                           f"unset it (or set it to torch) to use torch's decode + cuBLAS")
    _fallback = reason
    return f"offspec's Triton kernels cannot run here ({reason}): using torch's decode + cuBLAS instead"


def fallback() -> Optional[str]:
    """Why this process fell back to the torch path, or None."""
    return _fallback


@functools.lru_cache(maxsize=8)
def _choice(value: str, have_triton: bool) -> str:
    choice = value.strip().lower() or "auto"
    if choice not in CHOICES:
        raise OffspecError(f"{VARIABLE}={choice}: use auto (Triton where installed), triton or torch")
    if choice == "triton" and not have_triton:
        raise OffspecError(f"{VARIABLE}=triton but Triton is not installed: `pip install triton`, or unset it")
    if choice == "auto":
        return "triton" if have_triton else "torch"
    return choice
