"""Measured curves the planner works from: seconds vs size, and accepted tokens vs tree budget.

Both are piecewise linear through measured points. Cost curves extrapolate past their last point
with the slope of the last segment (once a pass is compute-bound its time grows linearly); acceptance
never extrapolates upward (past the largest budget measured, a bigger tree is assumed to gain nothing),
so the planner cannot pick a budget for a benefit nobody measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from offspec.errors import OffspecError


@dataclass(frozen=True)
class CostCurve:
    """Seconds vs size: tokens in one target pass, or nodes expanded in one draft step."""

    points: tuple[tuple[int, float], ...]  # (size, seconds), sizes strictly increasing

    @classmethod
    def of(cls, points: Sequence[Sequence[float]], what: str = "cost curve") -> "CostCurve":
        pts = tuple(sorted((int(n), float(s)) for n, s in points))
        if not pts:
            raise OffspecError(f"{what} has no points; measure it again with `offspec profile`")
        if any(n <= 0 or not (s >= 0) or math.isinf(s) for n, s in pts):
            raise OffspecError(f"{what} has a size <= 0 or a negative or infinite time: {pts}")
        merged: dict[int, float] = {}
        for n, s in pts:  # a repeated size keeps its fastest time
            merged[n] = min(s, merged.get(n, s))
        sizes = sorted(merged)
        envelope, low = [], math.inf
        for n in reversed(sizes):  # more work is never faster: the lower non-decreasing envelope drops noise spikes
            low = min(low, merged[n])
            envelope.append((n, low))
        return cls(tuple(reversed(envelope)))

    def __call__(self, n: float) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]  # below the smallest size measured: no cheaper than it
        if len(pts) == 1:
            return pts[0][1] * n / pts[0][0]  # one point only: assume compute-bound above it (pessimistic)
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        slope = max(0.0, (s1 - s0) / (n1 - n0))
        return s1 + slope * (n - n1)

    @property
    def largest(self) -> int:
        return self.points[-1][0]

    def scaled(self, factor: float) -> "CostCurve":
        """Every time multiplied by `factor` (a machine that got slower or faster than when measured)."""
        return CostCurve(tuple((n, s * factor) for n, s in self.points))

    def as_lists(self) -> list[list[float]]:
        return [[n, round(s, 7)] for n, s in self.points]


@dataclass(frozen=True)
class AcceptanceCurve:
    """Mean accepted draft tokens per target pass vs tree budget (the bonus token is not counted).

    `samples` (optional) holds, per calibration pass, the accepted count at every budget: with it, the
    effect of a depth cap is exact on the measured passes (a cap d turns each count a into min(a, d)).
    `depths` (optional) is the mean deepest tree level at each budget (how many draft steps a tree needs).
    `model_share` (hybrid drafting): the share of passes in which the draft model ran (the others took
    the suffix candidates alone, SuffixDecoding's adaptive speculation); 1 for the model drafter.
    `keep` (online adaptation, `thinned`): each accepted token of a calibration pass kept with this chance given
    the ones before it, so a path of a accepted tokens yields sum_{k<=a} keep^k (1: the curve as measured).
    """

    budgets: tuple[int, ...]
    accepted: tuple[float, ...]
    depths: tuple[float, ...] = ()
    samples: tuple[tuple[int, ...], ...] = ()
    model_share: float = 1.0
    keep: float = 1.0
    # max_depth -> _values(max_depth): the policy asks for the same few caps on every pass (its own, not compared)
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, budgets: Sequence[int], accepted: Sequence[float], depths: Sequence[float] = (),
           samples: Sequence[Sequence[int]] = (), what: str = "acceptance curve",
           model_share: float = 1.0) -> "AcceptanceCurve":
        budgets, accepted = tuple(int(b) for b in budgets), tuple(float(a) for a in accepted)
        if not budgets or len(budgets) != len(accepted):
            raise OffspecError(f"{what}: budgets and accepted must be non-empty lists of the same length")
        if any(b <= 0 for b in budgets) or list(budgets) != sorted(set(budgets)):
            raise OffspecError(f"{what}: budgets must be positive and strictly increasing, got {list(budgets)}")
        if depths and len(depths) != len(budgets):
            raise OffspecError(f"{what}: depths must have one value per budget")
        if any(len(s) != len(budgets) for s in samples):
            raise OffspecError(f"{what}: each sample must have one accepted count per budget")
        if not 0.0 <= model_share <= 1.0:
            raise OffspecError(f"{what}: model_share must be in [0, 1], got {model_share}")
        monotone, best = [], 0.0
        for a in accepted:  # a bigger tree contains the smaller one: acceptance never drops with the budget
            best = max(best, a)
            monotone.append(best)
        return cls(budgets, tuple(monotone), tuple(float(d) for d in depths),
                   tuple(tuple(int(x) for x in s) for s in samples), float(model_share))

    def thinned(self, keep: float) -> "AcceptanceCurve":
        """This curve where each drafted token is accepted `keep` times as often as at calibration, given the
        tokens before it on its path (prose after code: the draft agrees less). A uniform scale of the mean
        takes as much from a one-node chain as from a deep tree; here a path loses more the deeper it goes, as
        the acceptance of chains 1 to 3 on MT-Bench against the code prior did (docs/design/planning.md)."""
        if not 0.0 < keep <= 1.0:
            raise OffspecError(f"keep must be in (0, 1], got {keep}")
        return replace(self, keep=float(keep))

    def _kept(self, accepted: float) -> float:
        """sum_{k=1}^{a} keep^k: what a path of `accepted` tokens yields when each is kept with chance `keep`
        (fractional a: the same closed form)."""
        q = self.keep
        if q >= 1.0:
            return accepted
        return q * (1.0 - q ** accepted) / (1.0 - q)

    def _values(self, max_depth: Optional[int]) -> tuple[float, ...]:
        values = self._memo.get(max_depth)
        if values is None:
            values = self._memo[max_depth] = self._compute(max_depth)
        return values

    def _compute(self, max_depth: Optional[int]) -> tuple[float, ...]:
        cap = math.inf if max_depth is None else max_depth
        if self.samples and (max_depth is not None or self.keep < 1.0):
            n = len(self.samples)
            return tuple(sum(self._kept(min(s[i], cap)) for s in self.samples) / n for i in range(len(self.budgets)))
        return tuple(self._kept(min(a, cap)) for a in self.accepted)

    def __call__(self, budget: float, max_depth: Optional[int] = None) -> float:
        """Interpolated in log2(budget); 0 at budget 0; flat past the largest budget measured."""
        values = self._values(max_depth)
        if budget <= 0:
            return 0.0
        if budget <= self.budgets[0]:
            return values[0] * budget / self.budgets[0]
        x = math.log2(budget)
        for b0, a0, b1, a1 in zip(self.budgets, values, self.budgets[1:], values[1:]):
            if budget <= b1:
                x0, x1 = math.log2(b0), math.log2(b1)
                return a0 + (a1 - a0) * (x - x0) / (x1 - x0)
        return values[-1]

    def depth(self, budget: float) -> float:
        """Mean deepest level of a tree of `budget` nodes (a draft step reaches one level deeper)."""
        if not self.depths:
            return min(float(budget), 1.0 + math.log2(1.0 + budget))  # no data: a bushy tree's depth
        if budget <= self.budgets[0]:
            return max(1.0, self.depths[0] * budget / self.budgets[0])
        for b0, d0, b1, d1 in zip(self.budgets, self.depths, self.budgets[1:], self.depths[1:]):
            if budget <= b1:
                return d0 + (d1 - d0) * (math.log2(budget) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
        return self.depths[-1]

    @property
    def largest(self) -> int:
        return self.budgets[-1]
