"""Per-pass tree size by expected gain: verify a node only where it pays for its place in the target's pass.

A target pass costs `base + per_node * n` seconds for n tree nodes, or as measured points say (and `head` per
position of the acceptance walk). Where weights stream (a GPU fed over PCIe, a disk) `per_node` is near zero and every
node is worth proposing; on a CPU with the weights in memory a pass is compute-bound and each node costs a
good share of a whole pass (on the 2-core test box about 0.09 s + 0.03 s per node), so a node that will
probably be rejected makes the pass slower than the target alone.

Given each candidate's probability of being accepted (the probability that its whole path is the target's),
the expected tokens of a pass with the first n candidates are 1 + (sum of their probabilities), and
`best_prefix` picks the n that maximizes expected tokens per second, 0 included (a plain pass).

`ContinuationRates` estimates, online, the probability that the target continues a suffix match by one more
token (the suffix drafter's q), per match length: long matches of copied code continue almost surely, a
one-token match rarely. Each verified proposal is a run of successes ended by a failure, or censored when
the proposal ran out first (a geometric model); a prior of `prior_weight` pseudo-steps at
m / (m + half) starts each bucket. Pure Python: no model, no tensors.
"""

from __future__ import annotations

import math
from typing import Sequence

from offspec.config import PassCost


def best_prefix(probabilities: Sequence[float], cost: PassCost, draft_seconds: float = 0.0) -> int:
    """How many of the candidates (best first; every node after its parent) to verify: the n in
    [0, len] that maximizes (1 + sum of the first n probabilities) / seconds of that pass.
    Ties go to the smaller tree."""
    best_n, best_rate = 0, 1.0 / (draft_seconds + cost.seconds(0, 1.0))
    expected = 1.0
    for n, p in enumerate(probabilities, start=1):
        expected += p
        rate = expected / (draft_seconds + cost.seconds(n, expected))
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    return best_n


class ContinuationRates:
    """Probability that the target continues a suffix match one more token, by match length (online)."""

    def __init__(self, half: float = 2.0, prior_weight: float = 4.0, max_length: int = 32):
        self.half = half  # the prior trusts a match of this length half: m / (m + half)
        self.prior_weight = prior_weight  # pseudo-steps of the prior in each bucket
        self.max_length = max_length
        n = self._bucket(max_length) + 1
        self.successes = [0] * n  # continuations the target accepted, per bucket
        self.failures = [0] * n  # proposals the target left (a continuation existed, the target chose otherwise)

    def _bucket(self, m: int) -> int:
        """Match lengths 1, 2-3, 4-7, 8-15, 16-31, 32+: one bucket per doubling."""
        return int(math.log2(max(1, min(m, self.max_length))))

    def rate(self, m: int) -> float:
        if m <= 0:
            return 0.0
        b = self._bucket(m)
        prior = m / (m + self.half)
        s, f = self.successes[b], self.failures[b]
        return (s + self.prior_weight * prior) / (s + f + self.prior_weight)

    def observe(self, m: int, accepted: int, left: bool) -> None:
        """A verified proposal from a match of length m: `accepted` tokens taken, and whether the target
        then left the proposal (False: the proposal ended first, so the run was cut short, not ended)."""
        if m <= 0:
            return
        b = self._bucket(m)
        self.successes[b] += accepted
        self.failures[b] += int(left)

    def summary(self) -> dict:
        return {f"{1 << b}+": [self.successes[b], self.failures[b]] for b in range(len(self.successes))}
