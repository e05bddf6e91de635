"""Whole decoder layers in one compiled call on a CPU, for llama-family models with low-bit weights.

A transformers decoder layer dispatches about 150 torch operations and 14 module calls: 0.4-0.7 ms of Python per
layer on a CPU, whatever the weights. For the 0.5B draft (24 layers) that is a third of a draft step, for the 1.5B
target a sixth of a one-token pass. `install(model)` gives every layer of a supported model a forward that runs
the whole layer in `csrc/layer.h` (what transformers' layer computes, up to a norm's last bit: RMSNorm, the
projections on qgemm, the rotary embedding, the cache write, exact attention, the SiLU-gated MLP), within
`active(visible)`, which the runner enters around its own passes. Anything else (another caller, a cache that is not
the runner's, a pass outside the context) runs transformers' forward, so hooks and tests on the modules still see
every call they saw before.

Exactness: each row's result depends on that row alone (the row-invariant kernels, exact attention per query), so
a tree pass and a one-token pass compute the same bits, as the exact attention of `attention.py` does for the rest
of a transformers layer. A target runs every pass compiled, so its decoding passes never mix the two paths; a draft
(no exactness needed) runs its tree steps compiled and its long catch-ups on transformers' layers with SDPA, which
are faster there (`runner.COMPILED_MAX_TOKENS`).
"""

from __future__ import annotations

import os
import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import nn

from offspec.errors import OffspecError

from . import kernels
from .modules import QLinear

VARIABLE = "OFFSPEC_LAYERS"
SUPPORTED = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")

_state = threading.local()


@contextmanager
def active(visible: Optional[torch.Tensor]) -> Iterator[None]:
    """Within this context (in this thread), installed layers run compiled, attending as `visible` (q, kv_len) bool
    allows (the runner's pass); None: transformers' forward."""
    previous = getattr(_state, "visible", None)
    _state.visible = visible
    try:
        yield
    finally:
        _state.visible = previous


def unsupported(model: nn.Module) -> Optional[str]:
    """None when every decoder layer of `model` can run compiled, else why not (then transformers' layers run)."""
    config = model.config
    # Mistral applies its window whenever it has one; Qwen2 only with use_sliding_window
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "hidden_act", "silu") != "silu":
        return f"attention softcapping or the {getattr(config, 'hidden_act', '?')} activation"
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        return "no decoder layers"
    for layer in layers:
        if type(layer).__name__ not in SUPPORTED:
            return f"{type(layer).__name__} is not a llama-family layer"
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            if not isinstance(module, QLinear):
                return f"{name} holds {type(module).__name__} weights, not ggml blocks"
            if name.rsplit(".", 1)[1] not in ("q_proj", "k_proj", "v_proj") and module.bias is not None:
                return f"{name} has a bias"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms) \
                or norms[0].variance_epsilon != norms[1].variance_epsilon:
            return "the layer's norms are not two RMSNorms of one epsilon"
    if kernels.compiled() is None:
        return f"the CPU kernels are unavailable ({kernels.kernel_status()})"
    return None


def install(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Give `model`'s layers the compiled forward where they can run it (a CPU, float32, a supported model); returns
    None when installed, else why not. `OFFSPEC_LAYERS=transformers` keeps transformers' layers (an A/B switch)."""
    choice = os.environ.get(VARIABLE, "").strip().lower() or "auto"
    if choice not in ("auto", "transformers"):
        raise OffspecError(f"{VARIABLE}={choice}: use transformers (no compiled layers) or auto")
    if choice == "transformers":
        return f"{VARIABLE}=transformers"
    if device.type != "cpu" or dtype != torch.float32:
        return "compiled layers run on a CPU in float32"
    reason = unsupported(model)
    if reason is None:
        config = model.config
        for layer in model.get_decoder().layers:
            if not hasattr(layer, "_offspec_hf_forward"):
                attn = layer.self_attn
                # looked up once: a transformers config attribute costs microseconds, and a pass reads 28 layers
                layer._offspec_parts = _Parts(
                    tuple(layer.get_submodule(name) for name in PROJECTIONS), (attn.q_proj, attn.k_proj, attn.v_proj),
                    (layer.input_layernorm, layer.post_attention_layernorm),
                    float(layer.input_layernorm.variance_epsilon),
                    config.num_attention_heads, config.num_key_value_heads, float(attn.scaling), attn.layer_idx)
                layer._offspec_hf_forward = layer.forward
                layer.forward = types.MethodType(_forward, layer)
    return reason


class _Parts(NamedTuple):
    projections: tuple  # the 7 QLinear modules, PROJECTIONS' order (their weights are read at each call: streaming
    biased: tuple  # binds them for the pass); q, k and v, whose biases the layer adds
    norms: tuple  # input_layernorm, post_attention_layernorm
    eps: float
    heads: int
    kv_heads: int
    scaling: float
    layer_idx: int


def _forward(layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    visible = getattr(_state, "visible", None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the runner's SlotKVCache (it has `buffers`)
    position_embeddings = kwargs.get("position_embeddings")
    if (visible is None or args or not hasattr(cache, "buffers") or position_embeddings is None
            or hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.dtype != torch.float32):
        return layer._offspec_hf_forward(hidden_states, *args, **kwargs)
    parts: _Parts = layer._offspec_parts
    cos, sin = position_embeddings  # (1, q, head_dim) each
    k_cache, v_cache = cache.buffers(parts.layer_idx, hidden_states, parts.kv_heads, cos.shape[-1])
    out = kernels.compiled().decoder_layer(
        hidden_states[0].contiguous(), [p.qweight for p in parts.projections], [p.type_id for p in parts.projections],
        [p.bias for p in parts.biased], parts.norms[0].weight, parts.norms[1].weight, parts.eps,
        cos[0].float().contiguous(), sin[0].float().contiguous(), k_cache, v_cache, cache.write_slots, cache.kv_len,
        visible, parts.heads, parts.kv_heads, parts.scaling)  # (q, hidden)
    return out[None]
