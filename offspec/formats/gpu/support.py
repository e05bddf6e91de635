"""Whether offspec's CUDA decoder layers (layer.py) can run a model, and why not where they cannot."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..modules import QLinear
from .choice import cuda_kernels, fallback

SUPPORTED = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYERS_VARIABLE = "OFFSPEC_LAYERS"  # =transformers keeps transformers' layers (formats/layers.py reads it too)


def cuda_layers(model: Any, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when offspec's CUDA layers (layer.py) run `model`'s passes on `device`, else why transformers' run."""
    if os.environ.get(LAYERS_VARIABLE, "").strip().lower() == "transformers":
        return f"{LAYERS_VARIABLE}=transformers"
    if device.type != "cuda":
        return "offspec's CUDA layers run on CUDA"
    if fallback() is not None:
        return f"offspec's CUDA layers need the Triton kernels, which cannot run on this GPU ({fallback()})"
    if cuda_kernels() != "triton":
        return "offspec's CUDA layers need the Triton kernels (OFFSPEC_CUDA_KERNELS, or Triton is missing)"
    if dtype not in DTYPES:
        return f"offspec's CUDA layers compute in bfloat16, float16 or float32, not {dtype}"
    return unsupported(model)


def unsupported(model: Any) -> Optional[str]:
    """None when every decoder layer of `model` can run offspec's CUDA layer, else why not."""
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
