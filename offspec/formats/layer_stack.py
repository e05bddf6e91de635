"""A resident model's decoder layers in one compiled call on a CPU (csrc/layer_stack.h), for the plainest families.

Their model's forward (`PLAIN_BODIES`) is the token embedding, the rotary embedding, the layers and the final norm,
nothing more. `stack_forward` runs all the layers (each installed by `layers.install`) in one call, without
transformers' model loop, module calls and argument lists in between (2-3 ms of a 28-layer pass). Where the
embedding is a table of ggml rows, the same call embeds the tokens and applies the final norm, one native call checks
that nothing the stack holds was bound anew (`_Stack.current`), and cos and sin come from a table (`_rotary`):
another 0.5-0.7 ms of a pass's Python. `install_final_norm` gives such a body's final norm layer.h's RMSNorm, so
that a pass gives the same bits whether its layers run in one call or one by one (`USE_STACK = False`, for
comparing; streamed layers, whose weights are bound in their hooks, always do).
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from . import kernels
from .layers import LayerParts, norm_eps
from .modules import QEmbedding, QLinear

# transformers' model classes whose forward is embed -> rotary embedding -> the layers -> final norm and nothing else
PLAIN_BODIES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "Phi3Model"})
USE_STACK = True  # False: `stack_forward` declines (every pass runs layer by layer through the model's forward)


class _Stack(NamedTuple):
    native: Any  # the compiled LayerStack
    tensors: list  # the weights, biases and norms it holds: rebuilt once any is no longer its module's own
    types: list  # the kernel types it was given
    windows: tuple  # the window of each mask `forward` takes, in its order
    holders: tuple  # (holder, name) per tensor: where its module holds it (`_holder`), so a pass checks it quickly
    projections: tuple  # the layers' QLinears in `types`' order (None where absent)
    watched: bool  # the native stack checks all it holds itself (`LayerStack.unchanged`), hooks included
    body: bool  # the embedding and the final norm are bound too: `run` takes token ids

    def current(self, body: nn.Module) -> bool:
        """Whether every tensor is still its module's own, every kernel type the same and no layer has hooks (an
        interleaved weight keeps its tensor, so the types are read again too). Watched: one native call, tens of
        microseconds; else in Python, about 60 us warm and 0.3 ms after a pass for a 28-layer model."""
        if self.watched:
            return self.native.unchanged()
        if _hooked(body):
            return False
        try:
            held = all(h[name] is t for (h, name), t in zip(self.holders, self.tensors))
        except KeyError:  # no longer where it was held (a parametrization took it, say): bound anew
            return False
        return held and all((p.kernel_type if p is not None else -1) == k for p, k in zip(self.projections, self.types))


def _hooked(body: nn.Module) -> bool:
    """Whether any of `body`'s layers has forward hooks (streaming binds a layer's weights in its hooks)."""
    return any(layer._forward_pre_hooks or layer._forward_hooks for layer in body.layers)


_ABSENT = {"": None}  # the holder of a tensor whose module is absent


class _Attributes:
    """A module's attributes read by name, as a holder (`module[attr]`) for what its own dicts do not hold."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __getitem__(self, attr: str) -> Any:
        return getattr(self.module, attr)


def _holder(module: Optional[nn.Module], attr: str) -> tuple[Any, str]:
    """(what holds `module.attr`: its parameters', its buffers' or its own dict, else its attributes; the key there).
    Read through the dicts, a pass's check skips nn.Module.__getattr__ (about a microsecond a read)."""
    if module is None:
        return _ABSENT, ""
    d = module.__dict__
    for held in (d["_parameters"], d["_buffers"], d):
        if attr in held:
            return held, attr
    return _Attributes(module), attr


def _holders(parts: LayerParts) -> list[tuple[Any, str]]:
    """`_holder` of each of a layer's tensors: 7 weights, 4 biases, 6 norms (None where absent), in that order."""
    return [_holder(p, "qweight") for p in parts.projections] + [_holder(p, "bias") for p in parts.biased] + \
        [_holder(n, "weight") for n in parts.norms]


def stack_forward(body: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: Any,
                  visibles: dict) -> Optional[torch.Tensor]:
    """The (q, hidden) final hidden states of `tokens` (q,) at `positions` (q,) through `body` (the model's
    decoder, every layer installed), its layers in one compiled call, attending as `visibles` ({window: (q, kv_len)
    bool}) allows; None where this body cannot (another family, a layer not installed): then run its forward. The
    caller's cache is prepared (write slots, kv_len). Layers with hooks (streamed ones: their weights are bound in
    their hooks) keep the model's loop."""
    if not USE_STACK or type(body).__name__ not in PLAIN_BODIES:
        return None
    all_parts = body.__dict__.get("_offspec_stack_parts")
    if all_parts is None:  # looked up once
        found = [getattr(layer, "_offspec_parts", None) for layer in body.layers[: body.config.num_hidden_layers]]
        all_parts = found if all(isinstance(p, LayerParts) for p in found) else []
        body._offspec_stack_parts = all_parts
    if not all_parts:
        return None
    stack: Optional[_Stack] = body.__dict__.get("_offspec_stack")
    if stack is None or not stack.current(body):  # a rebound or re-laid weight rebuilds it
        if _hooked(body):
            return None  # streaming binds a layer's weights in its hooks; any hook sees every call it saw before
        stack = _build_stack(body, all_parts)
        body._offspec_stack = stack
    cos, sin = _rotary(body.rotary_emb, positions)  # (q, rotary dims) float32 each
    keys, values = [], []
    for parts in all_parts:
        k, v = cache.buffers(parts.layer_idx, _LIKE, parts.kv_heads, parts.head_dim)
        keys.append(k)
        values.append(v)
    masks = [visibles[w] for w in stack.windows]
    if stack.body:  # embedding, layers and final norm in the one call
        return stack.native.run(tokens, cos, sin, keys, values, cache.write_slots, cache.kv_len, masks)  # (q, hidden)
    hidden = body.embed_tokens(tokens[None])  # (1, q, hidden)
    out = stack.native.forward(hidden[0].contiguous(), cos, sin, keys, values, cache.write_slots, cache.kv_len, masks)
    return body.norm(out[None])[0]  # (q, hidden)


_LIKE = torch.empty(0)  # float32 on the CPU: the dtype and device the rotary embedding and the cache take
_STATIC_ROPES = frozenset({"default", "linear", "llama3", "yarn"})  # rotary embeddings of the position alone
_ROTARY_BLOCK = 128  # positions a table computes per call: under torch's grain for head dims up to 256, so one thread


def _rotary(rotary: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, rotary dims) float32 cos and sin of `positions` (q,) long, as `rotary` (the model's rotary embedding)
    computes them: rows of a table it computed for positions [0, n), grown by doubling (0.1 ms a pass less than
    computing them). Static embeddings only (their rows depend on the position alone); the others (dynamic,
    longrope: frequencies that follow the length) are computed per pass. The table is computed in blocks of 128
    positions, each on one thread over whole vectors, so that a row's bits never depend on where a call split
    torch's elementwise loops (the same bits as computing one position alone: tests)."""
    if getattr(rotary, "rope_type", None) not in _STATIC_ROPES or getattr(rotary, "inv_freq", None) is None:
        cos, sin = rotary(_LIKE, position_ids=positions[None])  # (1, q, rotary dims) each
        return cos[0].float().contiguous(), sin[0].float().contiguous()
    table = rotary.__dict__.get("_offspec_rotary")
    need = int(positions.max()) + 1 if positions.numel() else 0
    if table is None or table[0].shape[0] < need or table[2] is not rotary.inv_freq:
        size = max(8 * _ROTARY_BLOCK, table[0].shape[0] if table is not None else 0)
        while size < need:
            size *= 2
        blocks = [rotary(_LIKE, position_ids=torch.arange(b, b + _ROTARY_BLOCK)[None])
                  for b in range(0, size, _ROTARY_BLOCK)]  # ((1, 128, rotary dims) cos, sin) each
        table = (torch.cat([c[0] for c, _ in blocks]).float(), torch.cat([s[0] for _, s in blocks]).float(),
                 rotary.inv_freq)  # (size, rotary dims) each, and the frequencies they were computed from
        rotary._offspec_rotary = table
    return table[0].index_select(0, positions), table[1].index_select(0, positions)  # (q, rotary dims) each


def _build_stack(body: nn.Module, all_parts: list) -> _Stack:
    """The layers as they are bound now, in one compiled LayerStack (with the body's embedding and final norm where
    the stack can compute them, and what it holds watched where it can check it natively)."""
    holders = tuple(h for parts in all_parts for h in _holders(parts))
    tensors = [h[name] for h, name in holders]
    projections = tuple(p for parts in all_parts for p in parts.projections)
    kinds = [p.kernel_type if p is not None else -1 for p in projections]
    native = kernels.compiled().LayerStack()
    windows = tuple(dict.fromkeys(p.window for p in all_parts))
    for i, parts in enumerate(all_parts):
        t = tensors[17 * i : 17 * (i + 1)]
        native.add(t[:7], kinds[7 * i : 7 * (i + 1)], t[7:11], t[11:17], parts.eps, parts.offset, parts.heads,
                   parts.kv_heads, parts.head_dim, parts.scaling, parts.softcap, parts.activation,
                   windows.index(parts.window))
    watch = _watch_list(body, holders, tensors, projections)
    bound = _bind_body(native, body) if watch is not None else None
    if watch is not None:
        native.watch(watch + (bound or []))
    return _Stack(native, tensors, kinds, windows, holders, projections, watch is not None, bound is not None)


_KERNEL_TYPE_OF = ("type_id", "interleaved", "sums")  # the attributes QLinear.kernel_type is made of


def _watch_list(body: nn.Module, holders: tuple, tensors: list, projections: tuple) -> Optional[list]:
    """What `LayerStack.unchanged` checks of the layers: (holder dict, key, expected, kind) for each tensor (kind 0:
    the same object), the attributes each kernel type is made of (1: equal) and each layer's hooks (2: the same
    empty dict); None where some of it is not held in a dict (then `_Stack.current` checks in Python)."""
    entries = [(h, name, t, 0) for (h, name), t in zip(holders, tensors)]
    for p in projections:
        if p is None:
            continue
        if type(p).kernel_type is not QLinear.kernel_type or not all(a in p.__dict__ for a in _KERNEL_TYPE_OF):
            return None  # a subclass that makes its kernel type otherwise, or holds what it is made of elsewhere
        entries += [(p.__dict__, attr, p.__dict__[attr], 1) for attr in _KERNEL_TYPE_OF]
    for layer in body.layers:
        entries += [(layer.__dict__, attr, layer.__dict__[attr], 2) for attr in ("_forward_pre_hooks", "_forward_hooks")]
    return entries if all(isinstance(e[0], dict) for e in entries) else None


def _bind_body(native: Any, body: nn.Module) -> Optional[list]:
    """Give the stack `body`'s embedding and final norm where it computes them as the modules do (an embedding of
    ggml rows on the CPU, unscaled; the final norm `install_final_norm` gave layer.h's RMSNorm); returns what the stack must
    watch of them, or None where the modules run."""
    embed, norm = body.__dict__["_modules"].get("embed_tokens"), body.__dict__["_modules"].get("norm")
    if not isinstance(embed, QEmbedding) or embed.scale is not None or embed.compute_device.type != "cpu" \
            or embed.compute_dtype != torch.float32 or "qweight" not in embed._buffers \
            or embed._buffers["qweight"].device.type != "cpu" or norm is None \
            or not isinstance(norm.__dict__.get("forward"), types.MethodType) \
            or norm.__dict__["forward"].__func__ is not _norm_forward or "weight" not in norm._parameters \
            or norm._parameters["weight"].dtype != torch.float32 or not norm._parameters["weight"].is_contiguous():
        return None
    qweight, weight = embed._buffers["qweight"], norm._parameters["weight"]
    native.set_body(qweight, embed.type_id, weight, norm._offspec_eps, 0.0)
    modules = body.__dict__["_modules"]
    return [(modules, "embed_tokens", embed, 0), (modules, "norm", norm, 0), (embed._buffers, "qweight", qweight, 0),
            (embed.__dict__, "type_id", embed.type_id, 1), (embed.__dict__, "scale", embed.scale, 0),
            (norm._parameters, "weight", weight, 0), (norm.__dict__, "forward", norm.__dict__["forward"], 0),
            (norm.__dict__, "_offspec_eps", norm._offspec_eps, 1)]


def install_final_norm(body: nn.Module) -> None:
    """A plain body's final RMSNorm computed as `LayerStack.run` computes it (layer.h's, its sum taken in order), so
    that a pass gives the same bits whether its layers run in one call or one by one."""
    norm = getattr(body, "norm", None)
    if type(body).__name__ in PLAIN_BODIES and norm is not None and norm_eps(norm) is not None \
            and not type(norm).__name__.startswith("Gemma") and not hasattr(norm, "_offspec_hf_forward"):
        norm._offspec_eps = norm_eps(norm)  # looked up once (a pass reads it)
        norm._offspec_hf_forward = norm.forward
        norm.forward = types.MethodType(_norm_forward, norm)


def _norm_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = norm.weight
    if x.dtype != torch.float32 or x.device.type != "cpu" or weight.dtype != torch.float32:
        return norm._offspec_hf_forward(x)
    rows = kernels.compiled().rms_norm(x.reshape(-1, x.shape[-1]), weight, norm._offspec_eps, 0.0)  # (n, hidden)
    return rows.view(x.shape)
