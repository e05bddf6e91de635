"""How many prompt tokens one prefill pass of a streamed target may hold.

Every pass of a streamed target moves all its streamed layers once, so a prompt prefilled in 512-token chunks
streams the model once per 512 tokens (8 times for a 4k prompt). The placement reserved device memory for the
activations of the largest tree (`max_budget + 1` tokens over the full cache); a prefill chunk may be as large
as fits in that same reserve, by the same estimate, given how many tokens are cached before it.
"""

from __future__ import annotations

from typing import Any, Callable

from .estimates import activation_bytes


def largest_chunk(config: Any, reserve: int, cached: int, remaining: int, elem: int,
                  materialized_scores: bool = True) -> int:
    """The most of `remaining` tokens one causal pass over `cached` cached tokens may run with its activations
    (estimate, attention as `materialized_scores` says) within `reserve` bytes; at least 1 (a single token always
    runs: the reserve covers it)."""
    def fits(q: int) -> bool:  # grows with q
        return activation_bytes(config, q, cached + q, elem, materialized_scores=materialized_scores) <= reserve

    if remaining <= 1 or fits(remaining):
        return max(1, remaining)
    lo, hi = 1, remaining - 1  # fits(lo) or lo == 1; not fits(hi + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def chunk_planner(config: Any, reserve: int, elem: int, materialized_scores: bool = True) -> Callable[[int, int], int]:
    """`(cached, remaining) -> chunk` for `ModelRunner.prefill_chunk`."""
    return lambda cached, remaining: largest_chunk(config, reserve, cached, remaining, elem, materialized_scores)
