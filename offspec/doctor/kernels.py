"""The doctor's check of offspec's Triton kernels on this GPU: the kernel configurations a model's passes launch,
each compiled and launched once on tiny inputs (formats/gpu/probe.py, as the loader does before its first pass).

Without a model at hand it checks the usual ones: the default pair's weight types (Q4_K, Q6_K, Q5_0, Q8_0), a
70B Q4_K_M's IQ4_XS and a 70B IQ2_XXS's (a lattice type: its grid read from a device tensor), at a 4,096-wide input
with and without a bias, and the layer kernels of heads of 64 and 128.
"""

from __future__ import annotations

import torch

from offspec.formats.ggml import ggml_type
from offspec.formats.gpu.choice import VARIABLE, cuda_kernels

from .checks import FAIL, PASS, SKIP, Check, needs_cuda

NAME = "CUDA kernels"
TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_XS", "IQ2_XXS")
QUICK_TYPES = ("Q4_K", "Q6_K")
COLS = 4096


def kernels_check(device: torch.device, dtype: torch.dtype, quick: bool = False) -> Check:
    if device.type != "cuda" or not torch.cuda.is_available():
        return needs_cuda(NAME, device)
    if cuda_kernels() != "triton":
        return Check(NAME, SKIP, f"offspec's Triton kernels are not in use ({VARIABLE}, or Triton is not installed)")
    from offspec.formats.gpu.launch import card
    from offspec.formats.gpu.probe import LayerCase, LinearCase, probe

    types = QUICK_TYPES if quick else TYPES
    linears = {LinearCase(ggml_type(t).id, COLS, True, bias) for t in types for bias in ((False,) if quick else
                                                                                          (False, True))}
    layers = {LayerCase(COLS, 32, 8, 128), LayerCase(896, 14, 2, 64)}
    reason = probe(device, dtype, linears, (), layers)
    dtype_name = str(dtype).removeprefix("torch.")
    figures = {"card": card(device).name, "types": list(types), "dtype": dtype_name, "configurations":
               3 * len(linears) + len(layers)}
    if reason is not None:
        return Check(NAME, FAIL, f"{reason}; offspec would use torch's decode + cuBLAS here (slower)",
                     dict(figures, reason=reason))
    return Check(NAME, PASS, f"offspec's Triton kernels launch on {figures['card']} in {dtype_name}: the linears of "
                 f"{', '.join(types)} at every tiling, the attention and norms of heads of 64 and 128", figures)
