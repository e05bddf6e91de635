"""Memory estimates from a transformers config: KV cache and activations (headroom for the placement)."""

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


def context_limit(config: Any, max_context: int) -> int:
    return min(max_context, getattr(_text(config), "max_position_embeddings", None) or max_context)


def kv_cache_bytes(config: Any, slots: int, elem: int) -> int:
    """Keys and values of every layer for `slots` tokens (SlotKVCache pre-allocates its capacity)."""
    layers, _, _, _, kv_heads, head_dim, _ = _dims(config)
    return 2 * layers * kv_heads * head_dim * slots * elem


DRAFT_LOGIT_ROWS = 64  # the draft scores up to max_beams (<= 64 by default) expanded nodes per step


def activation_bytes(config: Any, tokens: int, kv_len: int, elem: int, logit_rows: int = 8) -> int:
    """Peak activations of one forward of `tokens` tokens over `kv_len` cache slots (a generous estimate):
    hidden states, q/k/v/o and MLP intermediates, one heads x tokens x kv_len score tensor, the 4D mask
    and its boolean source, and `logit_rows` rows of float32 logits."""
    _, hidden, inter, heads, _, _, vocab = _dims(config)
    per_token = (6 * hidden + 3 * inter) * elem
    scores = heads * tokens * kv_len * elem
    mask = tokens * kv_len * (elem + 1)
    return tokens * per_token + scores + mask + logit_rows * vocab * 4


def target_headroom(config: Any, max_context: int, max_budget: int, elem: int,
                    prefill_tokens: int = PREFILL_TOKENS) -> tuple[int, int]:
    """(KV cache, activations) of the target: the cache holds the context plus the largest tree; the activations
    are those of the largest tree or of a `prefill_tokens`-token prefill pass at the end of the context, whichever
    is larger (a streamed target prefills in the largest chunks this reserve allows: offload/prefill.py)."""
    ctx = context_limit(config, max_context)
    tree = max_budget + 1
    prefill = min(prefill_tokens, ctx)
    act = max(activation_bytes(config, tree, ctx + tree, elem), activation_bytes(config, prefill, ctx, elem))
    return kv_cache_bytes(config, ctx + tree, elem), act


def draft_headroom(config: Any, max_context: int, max_budget: int, elem: int, prefill_tokens: int = PREFILL_TOKENS,
                   head_rows: Optional[int] = None) -> int:
    """KV cache and activations of the draft (its cache also keeps scratch slots for the growing tree): its prefill
    passes hold at most `prefill_tokens` tokens (offspec.api sizes its chunks alike), and its logits rows have
    `head_rows` entries (a reduced head, offspec/models/draft_vocab.py; None: the vocabulary)."""
    ctx = context_limit(config, max_context)
    slots = ctx + 2 * (max_budget + 1) + 64  # as offspec.api sizes the draft's cache
    tokens = min(prefill_tokens, PREFILL_TOKENS, ctx)
    act = activation_bytes(config, tokens, slots, elem, DRAFT_LOGIT_ROWS)
    if head_rows is not None:  # the logits of a reduced head are narrower
        act -= DRAFT_LOGIT_ROWS * (_dims(config)[-1] - head_rows) * 4
    return kv_cache_bytes(config, slots, elem) + act
