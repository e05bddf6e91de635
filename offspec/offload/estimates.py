"""Memory and compute estimates from a transformers config: KV cache and activations (headroom for the placement),
and the largest tree a GPU can compute usefully in one pass.

Attention either materializes its scores (transformers' SDPA with a dense additive mask, rebuilt every pass: heads x
tokens x kv_len values) or does not (offspec's CUDA layers, formats/gpu: a float32 running state per query and head,
and the pass's (tokens, kv_len) bool pattern): `materialized_scores` says which the reserve is for.
"""

from __future__ import annotations

from typing import Any, Optional

from offspec.config import PREFILL_TOKENS  # a prefill pass of at least this many tokens fits in the reserve


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    c = _text(config)
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    return c.num_hidden_layers, c.hidden_size, inter, heads, kv_heads, head_dim, c.vocab_size


def matmul_params(config: Any) -> int:
    """Weights of the decoder layers' matrix products (q, k, v, o, gate, up, down): 2 FLOPs each per token of a pass
    (the LM head runs on the acceptance walk's rows only)."""
    layers, hidden, inter, heads, kv_heads, head_dim, _ = _dims(config)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attention + 3 * hidden * inter)


def context_limit(config: Any, max_context: int) -> int:
    return min(max_context, getattr(_text(config), "max_position_embeddings", None) or max_context)


def kv_cache_bytes(config: Any, slots: int, elem: int) -> int:
    """Keys and values of every layer for `slots` tokens (SlotKVCache pre-allocates its capacity)."""
    layers, _, _, _, kv_heads, head_dim, _ = _dims(config)
    return 2 * layers * kv_heads * head_dim * slots * elem


DRAFT_LOGIT_ROWS = 64  # the draft scores up to max_beams (<= 64 by default) expanded nodes per step


def activation_bytes(config: Any, tokens: int, kv_len: int, elem: int, logit_rows: int = 8,
                     materialized_scores: bool = True) -> int:
    """Peak activations of one forward of `tokens` tokens over `kv_len` cache slots (a generous estimate):
    hidden states, q/k/v/o and MLP intermediates, `logit_rows` rows of float32 logits, and attention's own: one
    heads x tokens x kv_len score tensor, the 4D mask and its boolean source (`materialized_scores`), or else the
    float32 running state (tokens x heads x (head_dim + 2)), the boolean pattern and each query's tail-slot list."""
    _, hidden, inter, heads, _, head_dim, vocab = _dims(config)
    per_token = (6 * hidden + 3 * inter) * elem
    if materialized_scores:
        attention = heads * tokens * kv_len * elem + tokens * kv_len * (elem + 1)
    else:
        attention = tokens * heads * (head_dim + 2) * 4 + tokens * kv_len + tokens * min(tokens, kv_len) * 4
    return tokens * per_token + attention + logit_rows * vocab * 4


def target_headroom(config: Any, max_context: int, max_budget: int, elem: int,
                    prefill_tokens: int = PREFILL_TOKENS, materialized_scores: bool = True) -> tuple[int, int]:
    """(KV cache, activations) of the target: the cache holds the context plus the largest tree; the activations
    are those of the largest tree or of a `prefill_tokens`-token prefill pass at the end of the context, whichever
    is larger (a streamed target prefills in the largest chunks this reserve allows: offload/prefill.py)."""
    ctx = context_limit(config, max_context)
    tree = max_budget + 1
    prefill = min(prefill_tokens, ctx)
    act = max(activation_bytes(config, tree, ctx + tree, elem, materialized_scores=materialized_scores),
              activation_bytes(config, prefill, ctx, elem, materialized_scores=materialized_scores))
    return kv_cache_bytes(config, ctx + tree, elem), act


def draft_headroom(config: Any, max_context: int, max_budget: int, elem: int, prefill_tokens: int = PREFILL_TOKENS,
                   head_rows: Optional[int] = None, materialized_scores: bool = True, own_cache: bool = True) -> int:
    """KV cache and activations of the draft (its cache also keeps scratch slots for the growing tree): its prefill
    passes hold at most `prefill_tokens` tokens (offspec.api sizes its chunks alike), and its logits rows have
    `head_rows` entries (a reduced head, offspec/models/draft_vocab.py; None: the vocabulary). `own_cache` False:
    a draft made from the target, which reads the target's cache (activations only, over the target's slots)."""
    ctx = context_limit(config, max_context)
    # as offspec.api sizes the draft's cache; a borrowed one is the target's
    slots = ctx + 2 * (max_budget + 1) + 64 if own_cache else ctx + max_budget + 1
    tokens = min(prefill_tokens, PREFILL_TOKENS, ctx)
    act = activation_bytes(config, tokens, slots, elem, DRAFT_LOGIT_ROWS, materialized_scores)
    if head_rows is not None:  # the logits of a reduced head are narrower
        act -= DRAFT_LOGIT_ROWS * (_dims(config)[-1] - head_rows) * 4
    return (kv_cache_bytes(config, slots, elem) if own_cache else 0) + act


FLOP_EFFICIENCY = 0.5  # share of a device's dense FLOP/s (datasheet or measured) the layers' products reach
COMPUTE_HEADROOM = 2.0  # a tree pass may compute this many times its floor (streaming or weight reads) at most
MIN_COMPUTE_BUDGET = 64


def compute_budget(params: float, flops: float, floor_seconds: float, ceiling: int = 4096,
                   headroom: float = COMPUTE_HEADROOM) -> int:
    """The largest power-of-two tree budget (MIN_COMPUTE_BUDGET .. ceiling) whose pass, (budget + 1) tokens of
    2 * params FLOPs each at `flops` usable FLOP/s, computes within `headroom` times `floor_seconds` (the pass's time
    at one token: its streaming, or reading the weights). A bigger tree makes the pass compute-bound: its time grows
    with every node while the accepted tokens grow with the log of the budget, so no plan picks it, and the KV cache
    and activations reserved for it would only keep layers off the device."""
    budget = MIN_COMPUTE_BUDGET
    while budget * 2 <= ceiling and 2 * params * (budget * 2 + 1) / flops <= headroom * floor_seconds:
        budget *= 2
    return min(budget, ceiling)
