"""Whole decoder layers in one compiled call on a CPU, for the families whose weights are low-bit blocks.

A transformers decoder layer dispatches about 150 torch operations and 14 module calls: 0.4-0.7 ms of Python per
layer on a CPU, whatever the weights. For the 0.5B draft (24 layers) that is a third of a draft step, for the 1.5B
target a sixth of a one-token pass. `install(model)` gives every layer of a supported model a forward that runs
the whole layer in `csrc/layer.h` (what transformers' layer computes, up to a norm's last bit: RMSNorm, the
projections on qgemm, q/k norms, the rotary embedding, the cache write, exact attention, sandwich norms, the gated
MLP), within `active(visible)`, which the runner enters around its own passes. Anything else (another caller, a
cache that is not the runner's, a pass outside the context) runs transformers' forward, so hooks and tests on the
modules still see every call they saw before.

Families (`FAMILY_LAYERS`): llama (Llama, SmolLM2), mistral, qwen2 (q/k/v biases), qwen3 (q/k norms), gemma2
(tanh-GELU, sandwich norms with a (1 + w) scale, attention logit soft-capping, local and global layers), gemma3
(gemma2's, with q/k norms instead of soft-capping, and a rope per layer type) and phi3 (fused q|k|v and gate|up
projections, partial rotary); of the mixtures (qwen3moe, qwen2moe, Mixtral, gpt-oss) the attention block (gpt-oss's
with biases on q, k, v and o, and attention sinks), then the sparse block. A layer's sliding window is in the mask it
is given (the runner builds one per window, `active`).

A resident model of the plainest families goes one step further: all its layers in one compiled call
(`layer_stack.py`).

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
from typing import Any, Iterator, NamedTuple, Optional, Union

import torch
from torch import nn

from offspec.errors import OffspecError

from . import kernels
from .attention import layer_windows
from .experts import QExperts
from .modules import QLinear

VARIABLE = "OFFSPEC_LAYERS"
# the decoder layer classes the compiled layer computes, by family
FAMILY_LAYERS = {"LlamaDecoderLayer": "llama", "MistralDecoderLayer": "mistral", "Qwen2DecoderLayer": "qwen2",
                 "Qwen3DecoderLayer": "qwen3", "Gemma2DecoderLayer": "gemma2", "Gemma3DecoderLayer": "gemma3",
                 "Phi3DecoderLayer": "phi3", "Qwen3MoeDecoderLayer": "qwen3moe", "Qwen2MoeDecoderLayer": "qwen2moe",
                 "MixtralDecoderLayer": "mixtral", "GptOssDecoderLayer": "gpt-oss"}
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # layer.h's Activation
# where each projection lives in a layer, in layer.h's order (q, k, v, o, gate, up, down); phi3 fuses q|k|v and
# gate|up into one projection each (None: fused into the one before it)
SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")


def projection_paths(layer: nn.Module) -> tuple:
    """The paths of `layer`'s 7 projections in layer.h's order, None where fused into the one before it."""
    attn = ("self_attn.qkv_proj", None, None) if _has(layer, "self_attn.qkv_proj") else SEPARATE[:3]
    mlp = ("mlp.gate_up_proj", None) if _has(layer, "mlp.gate_up_proj") else SEPARATE[4:6]
    return (*attn, SEPARATE[3], *mlp, SEPARATE[6])


_state = threading.local()


@contextmanager
def active(visible: Union[None, torch.Tensor, dict]) -> Iterator[None]:
    """Within this context (in this thread), installed layers run compiled, attending as `visible` (q, kv_len) bool
    allows (the runner's pass), or as `visible[w]` for a layer whose sliding window is w ({window: (q, kv_len)}, None
    the key of the layers without one); None: transformers' forward."""
    previous = getattr(_state, "visible", None)
    _state.visible = {None: visible} if isinstance(visible, torch.Tensor) else visible
    try:
        yield
    finally:
        _state.visible = previous


class LayerParts(NamedTuple):
    projections: tuple  # q, k, v, o, gate, up, down: QLinear modules (None where fused into the one before); their
    # weights and kernel types are read at each call (streaming binds them for the pass; a resident layer's rows may
    # be interleaved after install)
    biased: tuple  # q, k, v (the fused qkv, None, None) and o, whose biases the layer adds
    norms: tuple  # input, post-attention, pre-MLP, post-MLP, q, k: RMSNorm modules or None (layer.h's order)
    eps: float
    offset: float  # 1.0 for gemma's (1 + w) norms
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    softcap: float  # attention logits (0: none)
    activation: int
    window: Optional[int]  # the layer's sliding window (which of the runner's masks it takes)
    layer_idx: int
    moe: Optional[nn.Module] = None  # a mixture's sparse block: the compiled call runs the attention block alone,
    # and this block (its router and QExperts, csrc/experts.h) runs after it
    sinks: Optional[nn.Module] = None  # gpt-oss's attention, whose sinks (H,) are read at each call (streaming binds
    # them for the pass)
    half_rope: bool = False  # cos and sin hold each frequency once (gpt-oss), not twice as rotate_half's


def norm_eps(norm: nn.Module) -> Optional[float]:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if eps is not None and hasattr(norm, "weight") and type(norm).__name__.endswith("RMSNorm") \
        else None


def layer_parts(layer: nn.Module, config: Any, window: Optional[int]) -> Union[LayerParts, str]:
    """What the compiled layer needs of `layer`, or why it cannot compute it."""
    name = type(layer).__name__
    if name not in FAMILY_LAYERS:
        families = ", ".join(sorted(set(FAMILY_LAYERS.values())))
        return f"{name} is not a layer the compiled CPU layer computes (it computes {families})"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"the {act} activation"
    moe = _sparse_block(layer)
    if isinstance(moe, str):
        return moe
    projections = []
    paths = projection_paths(layer) if moe is None else (*SEPARATE[:4], None, None, None)
    for i, path in enumerate(paths):
        module = None if path is None else layer.get_submodule(path)
        if module is not None and not isinstance(module, QLinear):
            return f"{path} holds {type(module).__name__} weights, not ggml blocks"
        if module is not None and module.bias is not None and i > 3:
            return f"{path} has a bias"
        projections.append(module)
    attn = layer.self_attn
    if projections[1] is None and projections[0].bias is not None:
        return "the fused qkv projection has a bias"
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    norms = ((layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
              layer.post_feedforward_layernorm) if sandwich else
             (layer.input_layernorm, None, layer.post_attention_layernorm, None))
    norms += (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    present = [n for n in norms if n is not None]
    eps = {norm_eps(n) for n in present}
    if None in eps or len(eps) != 1:
        return "the layer's norms are not RMSNorms of one epsilon"
    offsets = {1.0 if type(n).__name__.startswith("Gemma") else 0.0 for n in present}
    if len(offsets) != 1:
        return "the layer mixes gemma and llama norms"
    head_dim = int(getattr(attn, "head_dim", 0) or config.hidden_size // config.num_attention_heads)
    gpt_oss = name == "GptOssDecoderLayer"
    return LayerParts(tuple(projections), tuple(projections[:4]), norms, eps.pop(), offsets.pop(),
                  config.num_attention_heads, config.num_key_value_heads, head_dim, float(attn.scaling),
                  float(getattr(attn, "attn_logit_softcapping", None) or 0.0), ACTIVATIONS[act], window,
                  attn.layer_idx, moe, attn if gpt_oss else None, gpt_oss)


def _sparse_block(layer: nn.Module) -> Union[None, nn.Module, str]:
    """A mixture's sparse block (offspec's QExperts in it), None for a dense layer, or why it cannot run."""
    block = getattr(layer, "mlp", None)
    if block is None or not hasattr(block, "experts"):
        return None
    if not isinstance(block.experts, QExperts):
        return f"{type(block).__name__}'s experts are not ggml blocks"
    return block


def _has(layer: nn.Module, path: str) -> bool:
    owner, _, attr = path.rpartition(".")
    return hasattr(layer.get_submodule(owner), attr)


def unsupported(model: nn.Module) -> Optional[str]:
    """None when every decoder layer of `model` can run compiled, else why not (then transformers' layers run)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        return "no decoder layers"
    windows = layer_windows(model.config)
    for layer, window in zip(layers, windows):
        parts = layer_parts(layer, model.config, window)
        if isinstance(parts, str):
            return parts
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
        for layer, window in zip(model.get_decoder().layers, layer_windows(model.config)):
            if not hasattr(layer, "_offspec_hf_forward"):
                # looked up once: a transformers config attribute costs microseconds, and a pass reads 28 layers
                layer._offspec_parts = layer_parts(layer, model.config, window)
                layer._offspec_hf_forward = layer.forward
                layer.forward = types.MethodType(_forward, layer)
    return reason


def _weight(module: Optional[nn.Module], attr: str) -> Optional[torch.Tensor]:
    return None if module is None else getattr(module, attr)


def _forward(layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    visible = getattr(_state, "visible", None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the runner's SlotKVCache (it has `buffers`)
    position_embeddings = kwargs.get("position_embeddings")
    if (visible is None or args or not hasattr(cache, "buffers") or position_embeddings is None
            or hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.dtype != torch.float32):
        return layer._offspec_hf_forward(hidden_states, *args, **kwargs)
    parts: LayerParts = layer._offspec_parts
    cos, sin = position_embeddings  # (1, q, rotary dims) each; gpt-oss's (1, q, rotary dims / 2)
    if parts.half_rope:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (1, q, rotary dims)
    k_cache, v_cache = cache.buffers(parts.layer_idx, hidden_states, parts.kv_heads, parts.head_dim)
    out = kernels.compiled().decoder_layer(
        hidden_states[0].contiguous(), [_weight(p, "qweight") for p in parts.projections],
        [p.kernel_type if p is not None else -1 for p in parts.projections],
        [_weight(p, "bias") for p in parts.biased], [_weight(n, "weight") for n in parts.norms], parts.eps,
        parts.offset, cos[0].float().contiguous(), sin[0].float().contiguous(), k_cache, v_cache, cache.write_slots,
        cache.kv_len, visible[parts.window], parts.heads, parts.kv_heads, parts.head_dim, parts.scaling,
        parts.softcap, parts.activation, None if parts.sinks is None else parts.sinks.sinks.detach())  # (q, hidden)
    if parts.moe is not None:  # the attention block ran: now the sparse block, as transformers' layer runs it
        x = layer.post_attention_layernorm(out[None])  # (1, q, hidden)
        y = parts.moe(x)
        return out[None] + (y[0] if isinstance(y, tuple) else y)  # gpt-oss's block also returns its router scores
    return out[None]
