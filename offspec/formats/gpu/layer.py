"""offspec's decoder layer on CUDA (llama family: Llama, Qwen2, Mistral), as formats/layers.py is on a CPU.

`install(model, device, dtype)` gives every decoder layer (and the final norm) a forward that runs `decoder_layer`
within `active(keys)`, which the runner enters around its passes with the pass's `TailKeys`; anything else (another
caller, a cache that is not the runner's) runs transformers' forward.

One layer: the RMSNorm (norm.py), q/k/v as ONE linear over the three weights' block rows (linear.py: the bytes as
they are, whatever their types), the rotary embedding with the cache write (norm.py), tree attention (attention.py),
the output projection, the residual add with the second RMSNorm in one kernel, gate/up as one linear, SiLU * up,
down, the residual add. Every step gives a row the bits it would get in any other batch, so a tree pass and the same
tokens decoded one by one agree bit for bit (docs/gpu-design.md).
"""

from __future__ import annotations

import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import TailKeys, attend
from .support import PROJECTIONS, cuda_layers
from .linear import linear
from .norm import add_rms_norm, rope_kv


_state = threading.local()


@contextmanager
def active(keys: Optional[TailKeys]) -> Iterator[None]:
    """Within this context (in this thread), installed layers run offspec's CUDA layer with this pass's attention
    pattern; None: transformers' forward."""
    previous = getattr(_state, "keys", None)
    _state.keys = keys
    try:
        yield
    finally:
        _state.keys = previous


class Parts(NamedTuple):
    """What a layer's forward reads, looked up once (the weights' bytes are read at each call: streaming binds them
    for the pass)."""

    projections: tuple  # the 7 QLinear modules, PROJECTIONS' order
    norms: tuple  # input_layernorm, post_attention_layernorm
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int


def install(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Give `model`'s layers and final norm offspec's CUDA forward; returns None when installed, else why not."""
    reason = cuda_layers(model, device, dtype)  # (a module global: tests stand a CPU in for CUDA through it)
    if reason is not None:
        return reason
    config = model.config
    decoder = model.get_decoder()
    for layer in decoder.layers:
        if hasattr(layer, "_offspec_gpu_parts"):
            continue
        attn = layer.self_attn
        layer._offspec_gpu_parts = Parts(
            tuple(layer.get_submodule(name) for name in PROJECTIONS),
            (layer.input_layernorm, layer.post_attention_layernorm), float(layer.input_layernorm.variance_epsilon),
            config.num_attention_heads, config.num_key_value_heads, attn.head_dim, float(attn.scaling),
            attn.layer_idx)
        layer._offspec_gpu_hf_forward = layer.forward
        layer.forward = types.MethodType(_forward, layer)
    norm = decoder.norm
    if not hasattr(norm, "_offspec_gpu_hf_forward"):
        norm._offspec_gpu_hf_forward = norm.forward
        norm.forward = types.MethodType(_norm_forward, norm)
    return None


def decoder_layer(h: torch.Tensor, parts: Parts, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, keys: TailKeys) -> torch.Tensor:
    """h (M, E) hidden states -> h after the layer. cos, sin (M, D); caches (Hkv, capacity, D) written at slots (M,)."""
    q, k, v, o, gate, up, down = parts.projections
    e = h.shape[1]
    _, x = add_rms_norm(h, None, parts.norms[0].weight, parts.eps)  # (M, E)
    bias = None
    if any(p.bias is not None for p in (q, k, v)):
        bias = torch.cat([(p.bias if p.bias is not None else torch.zeros(p.out_features, device=h.device)).to(h.dtype)
                          for p in (q, k, v)])  # (Nq + Nk + Nv,) as QLinear adds them: in the compute dtype
    qkv = linear(x, [(q.qweight, q.type_id), (k.qweight, k.type_id), (v.qweight, v.type_id)], e, bias)
    queries = rope_kv(qkv, cos, sin, slots, k_cache, v_cache, parts.heads, parts.kv_heads)  # (M, H, D)
    att = attend(queries, k_cache, v_cache, keys, parts.scaling)  # (M, H * D)
    h, x = add_rms_norm(h, linear(att, [(o.qweight, o.type_id)], o.in_features), parts.norms[1].weight, parts.eps)
    gu = linear(x, [(gate.qweight, gate.type_id), (up.qweight, up.type_id)], e)  # (M, 2 I)
    inter = gate.out_features
    act = F.silu(gu[:, :inter]) * gu[:, inter:]  # (M, I) as transformers' MLP: each value from itself
    return h + linear(act, [(down.qweight, down.type_id)], inter)


def _forward(layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    keys = getattr(_state, "keys", None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the runner's SlotKVCache (it has `buffers`)
    position_embeddings = kwargs.get("position_embeddings")
    if (keys is None or args or not hasattr(cache, "buffers") or position_embeddings is None
            or hidden_states.dim() != 3 or hidden_states.shape[0] != 1):
        return layer._offspec_gpu_hf_forward(hidden_states, *args, **kwargs)
    parts: Parts = layer._offspec_gpu_parts
    cos, sin = position_embeddings  # (1, q, head_dim) each
    k_cache, v_cache = cache.buffers(parts.layer_idx, hidden_states, parts.kv_heads, parts.head_dim)
    out = decoder_layer(hidden_states[0], parts, cos[0], sin[0], k_cache[0], v_cache[0], cache.write_slots, keys)
    return out[None]  # (1, q, hidden)


def _norm_forward(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The final norm, batch-invariant within the runner's passes (torch's row reduction is chosen by shape)."""
    if getattr(_state, "keys", None) is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        return norm._offspec_gpu_hf_forward(hidden_states)
    return add_rms_norm(hidden_states[0], None, norm.weight, float(norm.variance_epsilon))[1][None]
