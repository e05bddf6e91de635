"""Which compute runs low-bit weights on CUDA, and the device memory it takes (no Triton import: a CPU never
loads it). Whether offspec's CUDA decoder layers can run a model: support.py.

`OFFSPEC_CUDA_KERNELS`: `auto` (the default) runs offspec's Triton kernels (linear.py, layer.py) where Triton is
installed and the torch decode path (dequant.py, then cuBLAS) where it is not; `triton` insists on Triton (a
one-line error without it); `torch` keeps the torch path (an A/B switch for measurements).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from offspec.errors import OffspecError


VARIABLE = "OFFSPEC_CUDA_KERNELS"
CHOICES = ("auto", "triton", "torch")
# device memory of the linears' scratch (the largest band of decoded weight rows, linear.SCRATCH_BYTES) and of the
# fused kernel's float32 split partials (at most FUSED_MAX_ROWS x ~2 x SMs x 64 columns: a few MB): the placement
# charges it on CUDA
WORKSPACE_BYTES = 128 * 2**20 + 16 * 2**20


def cuda_kernels() -> str:
    """"triton" or "torch": what computes low-bit weights on CUDA, as `OFFSPEC_CUDA_KERNELS` and Triton allow."""
    return _choice(os.environ.get(VARIABLE, ""), importlib.util.find_spec("triton") is not None)


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
