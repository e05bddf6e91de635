"""Acceptance drift: how far a window of tree passes accepted from what the profile's curve predicts.

Two estimators over the same window (`WindowPass`: what a pass took, what the curve predicted, at which budget and
depth cap); the policy (offspec/profile/adapt.py) decides when to re-plan and with which:
- `ratio_scale`: sum(taken) / sum(predicted), with its standard error (a ratio estimator): the drift as one scale
  on the whole curve, and whether it moved beyond noise;
- `per_token_keep`: the `keep` of `AcceptanceCurve.thinned` under which the window's passes are predicted what they
  took in all: the drift as a chance per drafted token, given the ones before it on its path, so that a deep path
  loses more than a one-node chain (prose against a code prior does: docs/design/planning.md).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple, Optional, Sequence

from .curves import AcceptanceCurve


class WindowPass(NamedTuple):
    accepted: int  # draft tokens the target accepted
    predicted: float  # what the profile's curve predicted for this pass (scale 1)
    budget: int
    depth: int  # the depth cap the pass ran with


def expected_accepted(curve: AcceptanceCurve, budget: int, depth: int, scale: float = 1.0) -> float:
    """Accepted tokens a pass of `budget` nodes under a depth cap is expected to take: `curve` times `scale`, never
    more than the nodes or the depth allow."""
    return min(curve(budget, depth) * scale, float(budget), float(depth))


def ratio_scale(window: Sequence[WindowPass]) -> Optional[tuple[float, float]]:
    """(sum(taken) / sum(predicted), its standard error), or None without passes or predictions."""
    n = len(window)
    total = sum(w.predicted for w in window)
    if n == 0 or total <= 0:
        return None
    r = sum(w.accepted for w in window) / total
    sd = math.sqrt(sum((w.accepted - r * w.predicted) ** 2 for w in window) / max(1, n - 1))
    return r, max(sd / (math.sqrt(n) * (total / n)), 1e-9)


def per_token_keep(window: Sequence[WindowPass], curve: AcceptanceCurve, floor: float = 1e-3) -> float:
    """The `keep` in (floor, 1] under which `curve.thinned(keep)` predicts the window's passes what they took in all;
    1 where they took as much as `curve` predicts, or more. Bisection: a thinned curve grows with `keep`."""
    taken = sum(w.accepted for w in window)
    passes = Counter((w.budget, w.depth) for w in window)

    def predicted(keep: float) -> float:
        thinned = curve.thinned(keep)  # one curve per keep tried: its values are memoized across the passes
        return sum(n * expected_accepted(thinned, b, d) for (b, d), n in passes.items())

    if not window or taken >= predicted(1.0):
        return 1.0
    lo, hi = 1e-3, 1.0
    for _ in range(30):  # to 1e-9
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < taken else (lo, mid)
    return max(lo, floor)
