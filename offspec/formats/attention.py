"""Exact attention for the target's decoding passes on a CPU, as a transformers attention implementation.

Greedy speculation is lossless only if verifying a token computes the same numbers as the target alone would.
The linear layers guarantee it (kernels.py: row-invariant), and this attention does the rest: each query
attends over exactly the keys it may see, in slot order, with a fixed order of operations (csrc/attention.h),
so a tree node (prefix + ancestors) and the same token decoded alone (prefix + the same tokens, committed)
get bitwise equal results; fp32 SDPA does not (its blocking depends on the other queries and masked keys, and
the 8-bit activation blocks of the low-bit kernels would turn such last-bit differences into visible ones).

`install(model)` makes the model's attention go through `attention_forward`; it runs exactly while the
`exact()` context is active (the runner enables it for target-alone steps and tree passes) and is otherwise
transformers' SDPA (the draft's long passes), or plain attention where the model soft-caps its attention logits
(gemma2) or has attention sinks (gpt-oss: a learned logit per head in the softmax's sum): SDPA has neither. Where it
cannot run (CUDA, dtypes other than float32, no compiled kernels), SDPA runs instead: `exact_available(model)` says which.

Sliding windows (mistral, qwen2/3 with use_sliding_window, gemma2/3's local layers) are in the mask: the runner
builds each layer type's mask with its window (offspec.spec.runner), as transformers' own masks have it, so the
`sliding_window` argument adds nothing here.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from . import kernels

NAME = "offspec"
_state = threading.local()
_registered = False


@contextmanager
def exact(enabled: bool = True) -> Iterator[None]:
    """Within this context (in this thread), installed models attend exactly."""
    previous = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = previous


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """(Q, L) bool from the runner's (1, 1, Q, L) mask (additive: 0 where visible; or already boolean)."""
    m = mask[0, 0]
    return m if m.dtype == torch.bool else m == 0


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ext = kernels.compiled()
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")  # (H,) gpt-oss's attention sinks
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (getattr(_state, "on", False) and ext is not None and query.device.type == "cpu"
            and query.dtype == torch.float32 and attention_mask is not None and query.shape[0] == 1):
        out = ext.attend(query, key, value, _visible(attention_mask), float(scale), float(softcap),
                         None if sinks is None else sinks.detach())  # (1, Q, H, D)
        return out, None
    if softcap or sinks is not None:  # SDPA can neither soft-cap its logits nor add sinks
        return capped_attention(query, key, value, attention_mask, float(scale), float(softcap), sinks), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def capped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: float, softcap: float, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention with soft-capped logits (softcap > 0) and attention sinks (sinks (H,) or None), as transformers'
    eager gemma2 and gpt-oss attentions compute them: query (B, H, Q, D), key and value (B, Hkv, L, D), mask
    (B, 1, Q, L) additive or bool; returns (B, Q, H, D)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # (B, H, L, D)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # (B, H, Q, L)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:  # one more logit per head, whose weight is dropped: a key without a value
        column = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, column], dim=-1)  # (B, H, Q, L + 1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, Q, H, D)


def install(model: Any) -> None:
    """Route `model`'s attention through `attention_forward` (a registered transformers implementation)."""
    global _registered
    from transformers import AttentionInterface

    if not _registered:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, attention_forward)
        # masks built by transformers itself (its own generate(), e.g. the bench's hf peer) are SDPA's: the
        # runner passes its own 4D masks, which transformers forwards as they are
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    for config in {id(c): c for c in (model.config, getattr(model.config, "get_text_config", lambda: None)())
                   if c is not None}.values():
        config._attn_implementation = NAME


def exact_available(model: Any, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when the target's decoding passes attend exactly, else why not (the passes then use SDPA)."""
    if device.type != "cpu":
        return "exact attention runs on a CPU only"
    if dtype != torch.float32:
        return f"exact attention runs in float32, not {str(dtype).removeprefix('torch.')}"
    if kernels.compiled() is None:
        return f"the CPU kernels are unavailable ({kernels.kernel_status()})"
    return None


def layer_windows(config: Any) -> list[Optional[int]]:
    """Each decoder layer's sliding window in positions (a key is visible to a query less than that many positions
    back), or None where the layer attends to everything: gemma2/3's local layers and qwen2/3's sliding layers (their
    `layer_types`), every layer of a model with one window for all (mistral's `sliding_window`), else none."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[: config.num_hidden_layers]]
    if window is not None and not getattr(config, "use_sliding_window", True):
        window = None  # an older qwen2 config: the window is there, off
    return [window] * config.num_hidden_layers


def windowed(visible: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
             window: Optional[int]) -> torch.Tensor:
    """visible (q, kv_len) bool, less the keys `window` or more positions behind each query (as transformers'
    sliding-window masks and llama.cpp's SWA: visible while query position - key position < window).
    positions (q,), key_positions (kv_len,) long."""
    if window is None:
        return visible
    return visible & (positions[:, None] - key_positions[None, :] < window)  # (q, kv_len)

