"""Which compute runs low-bit weights and decoder layers on CUDA, and the device memory it takes (no Triton import:
a CPU never loads it).

`OFFSPEC_CUDA_KERNELS`: `auto` (the default) runs offspec's Triton kernels (linear.py, layer.py) where Triton is
installed and the torch decode path (dequant.py, then cuBLAS) where it is not; `triton` insists on Triton (a
one-line error without it); `torch` keeps the torch path (an A/B switch for measurements).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from typing import Any, Optional

import torch

from offspec.errors import OffspecError


VARIABLE = "OFFSPEC_CUDA_KERNELS"
CHOICES = ("auto", "triton", "torch")
# device memory of the linears' scratch (the largest band of decoded weight rows, linear.SCRATCH_BYTES) and of the
# fused kernel's float32 split partials (at most FUSED_MAX_ROWS x ~2 x SMs x 64 columns: a few MB): the placement
# charges it on CUDA
WORKSPACE_BYTES = 128 * 2**20 + 16 * 2**20
SUPPORTED = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYERS_VARIABLE = "OFFSPEC_LAYERS"  # =transformers keeps transformers' layers (formats/layers.py reads it too)


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


def cuda_layers(model: Any, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when offspec's CUDA layers (layer.py) run `model`'s passes on `device`, else why transformers' run."""
    if os.environ.get(LAYERS_VARIABLE, "").strip().lower() == "transformers":
        return f"{LAYERS_VARIABLE}=transformers"
    if device.type != "cuda":
        return "offspec's CUDA layers run on CUDA"
    if cuda_kernels() != "triton":
        return "offspec's CUDA layers need the Triton kernels (OFFSPEC_CUDA_KERNELS, or Triton is missing)"
    if dtype not in DTYPES:
        return f"offspec's CUDA layers compute in bfloat16, float16 or float32, not {dtype}"
    return unsupported(model)


def unsupported(model: Any) -> Optional[str]:
    """None when every decoder layer of `model` can run offspec's CUDA layer, else why not."""
    from ..modules import QLinear  # here: formats.kernels imports this module, and modules imports kernels

    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "hidden_act", "silu") != "silu":
        return f"attention softcapping or the {getattr(config, 'hidden_act', '?')} activation"
    decoder = model.get_decoder()
    if not getattr(decoder, "layers", None) or not hasattr(getattr(decoder, "norm", None), "variance_epsilon"):
        return "no decoder layers or no final RMSNorm"
    for layer in decoder.layers:
        if type(layer).__name__ not in SUPPORTED:
            return f"{type(layer).__name__} is not a llama-family layer"
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            if not isinstance(module, QLinear):
                return f"{name} holds {type(module).__name__} weights, not ggml blocks"
            if name.rsplit(".", 1)[1] not in ("q_proj", "k_proj", "v_proj") and module.bias is not None:
                return f"{name} has a bias"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
            return "the layer's norms are not RMSNorms"
        head_dim = layer.self_attn.head_dim
        if head_dim & (head_dim - 1) or head_dim < 16:
            return f"head dimension {head_dim} (offspec's CUDA attention takes powers of two from 16)"
    return None
