"""Exact attention for the target's decoding passes on a CPU, as a transformers attention implementation.

Greedy speculation is lossless only if verifying a token computes the same numbers as the target alone would.
The linear layers guarantee it (kernels.py: row-invariant), and this attention does the rest: each query
attends over exactly the keys it may see, in slot order, with a fixed order of operations (csrc/attention.h),
so a tree node (prefix + ancestors) and the same token decoded alone (prefix + the same tokens, committed)
get bitwise equal results; fp32 SDPA does not (its blocking depends on the other queries and masked keys, and
the 8-bit activation blocks of the low-bit kernels would turn such last-bit differences into visible ones).

`install(model)` makes the model's attention go through `attention_forward`; it runs exactly while the
`exact()` context is active (the runner enables it for target-alone steps and tree passes) and is otherwise
transformers' SDPA (prompt prefill, which both decoding modes share, and the draft). Where it cannot run
(CUDA, dtypes other than float32, no compiled kernels, attention softcapping), SDPA runs instead:
`exact_available(model)` says which.
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
    if (getattr(_state, "on", False) and ext is not None and query.device.type == "cpu"
            and query.dtype == torch.float32 and attention_mask is not None and query.shape[0] == 1
            and not kwargs.get("softcap") and kwargs.get("sliding_window") is None):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return ext.attend(query, key, value, _visible(attention_mask), float(scale)), None  # (1, Q, H, D)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


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
    if getattr(model.config, "attn_logit_softcapping", None) or getattr(model.config, "sliding_window", None) \
            and getattr(model.config, "use_sliding_window", False):
        return "this architecture's attention (softcapping or a sliding window) has no exact kernel"
    if kernels.compiled() is None:
        return f"the CPU kernels are unavailable ({kernels.kernel_status()})"
    return None
