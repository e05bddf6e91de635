"""Online adaptation: keep running acceptance statistics and re-plan the budget when they drift.

The profile's acceptance curve was measured on the calibration prompts; a conversation about code in
Python accepts more, prose in another language less. The policy compares each pass's accepted count
with the curve's prediction at the budget that pass used, over a sliding window, and models the drift as
one scale on the whole curve: scale = sum(observed) / sum(predicted) (a ratio estimator). When the
scale has moved by more than `tolerance` AND by more than `z` standard errors since the last plan, it
re-plans with the new scale (the planner's cost model is unchanged). Each pass's tree comes from
`next_tree()`, so PassStats.budget shows the budget in force; `summary()` (also kept in
`info.extra["budget_adaptive"]`) shows the scale, the observed vs predicted acceptance and the re-plans.
When the plan predicts that no tree beats the target alone (`speculates` is False), auto's passes run
without a tree.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

from ..config import TreeConfig
from ..types import PassStats
from .curves import AcceptanceCurve
from .planner import PairCosts, Plan, PlannerConfig, plan


@dataclass(frozen=True)
class AdaptConfig:
    window: int = 24  # passes in the running window
    min_passes: int = 8  # passes in the window before the first re-plan
    min_gap: int = 8  # passes between two re-plans
    tolerance: float = 0.2  # relative change of the acceptance scale that is worth a re-plan
    z: float = 2.0  # ... and it must be this many standard errors (not noise)
    min_scale: float = 0.05
    max_scale: float = 8.0


@dataclass(frozen=True)
class Replan:
    at_pass: int  # passes observed when it happened
    budget_from: int
    budget_to: int
    scale: float  # new acceptance scale (observed / profile)
    observed: float  # mean accepted per pass in the window
    predicted: float  # what the profile predicted for the same passes (scale 1)

    def as_dict(self) -> dict:
        return {"at_pass": self.at_pass, "budget_from": self.budget_from, "budget_to": self.budget_to,
                "scale": round(self.scale, 4), "observed": round(self.observed, 4),
                "predicted": round(self.predicted, 4)}


class AdaptiveBudget:
    """The budget policy of `budget="auto"`: `next_tree()` before each pass, `observe()` after it."""

    def __init__(self, costs: PairCosts, acceptance: AcceptanceCurve, planner: PlannerConfig = PlannerConfig(),
                 config: AdaptConfig = AdaptConfig(), extra: Optional[dict] = None, key: str = "budget_adaptive"):
        self.costs, self.acceptance, self.planner, self.config = costs, acceptance, planner, config
        self.plan: Plan = plan(costs, acceptance, planner)
        self.initial_plan = self.plan
        self.base_tree = self.plan.tree()  # the generator applies this policy while its `tree` is this object
        self.scale = 1.0
        self.window: deque[tuple[int, float]] = deque(maxlen=config.window)  # (accepted, predicted at scale 1)
        self.passes = 0
        self._last_replan = 0
        self.replans: list[Replan] = []
        self.extra = extra  # a dict (the generator's info.extra) where `summary()` is kept up to date, under `key`
        self.key = key
        self._publish()

    @property
    def tree(self) -> TreeConfig:
        return self.plan.tree()

    @property
    def speculates(self) -> bool:
        """False: the plan predicts no tree beats the target alone, so passes run without a tree. Such passes
        accept nothing to observe, so the policy stays there; a fixed --budget still speculates."""
        return self.plan.speculates

    def next_tree(self, base: TreeConfig) -> TreeConfig:
        """The tree for the next pass: the planned budget, beams, depth and drafter; the branch stays the caller's."""
        best = self.plan.best
        return replace(base, budget=best.budget, max_beams=best.max_beams, max_depth=best.max_depth,
                       drafter=best.drafter)

    def observe(self, stats: PassStats) -> None:
        if stats.tree_size <= 0 or stats.tree_size > stats.budget:  # not a speculative pass, or a confident suffix
            return  # pass beyond the budget (TreeConfig.confident_budget): the curve is per budget
        depth = self.plan.best.max_depth
        predicted = min(self.acceptance(stats.budget, depth), float(stats.budget), float(depth))
        self.window.append((stats.accepted, predicted))
        self.passes += 1
        if len(self.window) >= self.config.min_passes and self.passes - self._last_replan >= self.config.min_gap:
            self._maybe_replan()
        self._publish()

    def observed_scale(self) -> tuple[float, float]:
        """(scale, standard error) from the window: sum(observed) / sum(predicted)."""
        n = len(self.window)
        total_pred = sum(p for _, p in self.window)
        if n == 0 or total_pred <= 0:
            return self.scale, math.inf
        r = sum(a for a, _ in self.window) / total_pred
        residuals = [a - r * p for a, p in self.window]
        sd = math.sqrt(sum(x * x for x in residuals) / max(1, n - 1))
        se = sd / (math.sqrt(n) * (total_pred / n))
        return r, max(se, 1e-9)

    def _maybe_replan(self) -> None:
        r, se = self.observed_scale()
        change = abs(r - self.scale)
        if change <= self.config.tolerance * self.scale or change <= self.config.z * se:
            return
        scale = min(self.config.max_scale, max(self.config.min_scale, r))
        old = self.plan.best.budget
        self.plan = plan(self.costs, self.acceptance, self.planner, acceptance_scale=scale)
        self.scale = scale
        self._last_replan = self.passes
        n = len(self.window)
        self.replans.append(Replan(self.passes, old, self.plan.best.budget, scale,
                                   sum(a for a, _ in self.window) / n, sum(p for _, p in self.window) / n))

    def summary(self) -> dict:
        n = len(self.window)
        return {"drafter": self.plan.best.drafter, "budget": self.plan.best.budget,
                "max_beams": self.plan.best.max_beams,
                "max_depth": self.plan.best.max_depth, "acceptance_scale": round(self.scale, 4),
                "observed_accepted": round(sum(a for a, _ in self.window) / n, 4) if n else None,
                "predicted_accepted": round(self.scale * sum(p for _, p in self.window) / n, 4) if n else None,
                "predicted_tokens_per_second": round(self.plan.best.tokens_per_second, 4),
                "speculate": self.speculates,
                "passes_observed": self.passes, "replans": [e.as_dict() for e in self.replans[-10:]]}

    def _publish(self) -> None:
        if self.extra is not None:
            self.extra[self.key] = self.summary()
