"""NF4 (bitsandbytes' 4-bit NormalFloat) for float checkpoints on CUDA (`--quant nf4`), and its module.

`quantize_4bit` / `dequantize_4bit` / `matmul_4bit` (NF4, blocks of 64, no double quantization). Linear layers of
a quantized decoder layer become `QuantLinear`s whose tensors are views into the packed layer buffer (bound per
pass by the streamer's hooks); `bnb.matmul_4bit` uses its fused 4-bit GEMV for one token, dequantize + GEMM for
more. On a CPU, bitsandbytes' NF4 runs 10-30x slower than float32, so offspec refuses it there (--quant int4
stores ggml Q4_1 blocks with offspec's own kernels instead: offspec/formats). int8 is ggml Q8_0, not here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

BLOCKSIZE = 64  # NF4 absmax block (elements)
NF4_CODE_LEN = 16  # the NF4 code book: 16 float32 values


def quant_entries(kind: str, out_features: int, in_features: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors that store one quantized (out, in) weight."""
    n = out_features * in_features
    if kind == "nf4":
        if n % BLOCKSIZE or n % 2:
            raise ValueError(f"NF4 needs a weight size divisible by {BLOCKSIZE}, got {out_features}x{in_features}")
        return [("qweight", torch.uint8, (n // 2, 1)), ("absmax", torch.float32, (n // BLOCKSIZE,)),
                ("code", torch.float32, (NF4_CODE_LEN,))]
    raise ValueError(f"unknown quantization {kind!r}")


def quantize_weight(kind: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize an (out, in) weight; returns the tensors named by `quant_entries`, on the weight's device."""
    import bitsandbytes.functional as bnbF

    weight = weight.contiguous()
    if kind == "nf4":
        q, state = bnbF.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=False)
        return {"qweight": q, "absmax": state.absmax.float(), "code": state.code.float()}  # (n/2, 1), (n/64,), (16,)
    raise ValueError(f"unknown quantization {kind!r}")


def dequantize_weight(kind: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in `dtype` that the quantized tensors stand for (what the layer computes with)."""
    import bitsandbytes.functional as bnbF

    if kind == "nf4":
        state = _nf4_state(tensors["absmax"], tensors["code"], out_features, in_features, dtype)
        return bnbF.dequantize_4bit(tensors["qweight"], state).to(dtype)
    raise ValueError(f"unknown quantization {kind!r}")


def _nf4_state(absmax: torch.Tensor, code: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype):
    from bitsandbytes.functional import QuantState

    return QuantState(absmax=absmax, shape=torch.Size((out_features, in_features)), code=code, blocksize=BLOCKSIZE,
                      quant_type="nf4", dtype=dtype)


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as NF4 (buffers named by `quant_entries`)."""

    def __init__(self, kind: str, in_features: int, out_features: int, bias: Optional[torch.Tensor],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kind, self.in_features, self.out_features, self.compute_dtype = kind, in_features, out_features, dtype
        for name, tdtype, shape in quant_entries(kind, out_features, in_features):
            self.register_buffer(name, torch.empty(shape, dtype=tdtype, device=device))
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias, device=device), requires_grad=False)

    @classmethod
    def replacing(cls, linear: nn.Linear, kind: str, dtype: torch.dtype) -> "QuantLinear":
        """An empty QuantLinear on `linear`'s device (meta for a layer built without weights)."""
        return cls(kind, linear.in_features, linear.out_features, linear.bias, dtype, linear.weight.device)

    def load_quantized(self, tensors: dict[str, torch.Tensor], bias: Optional[torch.Tensor]) -> None:
        for name, value in tensors.items():
            self._buffers[name] = value
        if bias is not None:
            self._parameters["bias"] = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        state = _nf4_state(self.absmax, self.code, self.out_features, self.in_features, x.dtype)
        return bnb.matmul_4bit(x, self.qweight.t(), quant_state=state, bias=self.bias)  # (..., out)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


def quantize_layer_linears(layer: nn.Module, kind: str, dtype: torch.dtype) -> list[str]:
    """Replace every nn.Linear inside `layer` by an empty QuantLinear; returns their qualified names."""
    names = []
    for name, module in list(layer.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, QuantLinear.replacing(module, kind, dtype))
            names.append(name)
    return names
