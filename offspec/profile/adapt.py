"""Online adaptation: keep running acceptance and timing statistics and re-plan the budget when they drift.

Acceptance: the profile's acceptance curve was measured on the calibration prompts; a conversation about
code in Python accepts more, prose in another language less. The policy compares each pass's accepted count
with the curve's prediction at the budget that pass used, over a sliding window: scale = sum(observed) /
sum(predicted) (a ratio estimator). When the scale has moved by more than `tolerance` AND by more than `z`
standard errors since the last plan, it re-plans. A scale above 1 multiplies the whole curve. Below 1 the
drift is taken per token (`AcceptanceCurve.thinned`): each drafted token is accepted `keep` times as often as
at calibration given the ones before it, `keep` chosen so that the window's passes are predicted what they
took; a deep path then loses more than a one-node chain, as prose against the code prior does (MT-Bench:
chains of 1, 2, 3 nodes took 0.90, 0.77, 0.73 of the prior, where one scale takes the same share of each).
A re-plan that would stop speculating waits for a full window (`window` passes): without trees the draft
model's acceptance is never measured again, so that decision takes more evidence than any other (8 passes
of a 3-node tree on the first MT-Bench question measured 0.38 of the prior, 24 passes over the questions 0.75).

Timing: each pass's draft and target seconds are compared with what the cost model predicts for it. When
the median ratio of a window moves by more than `time_tolerance` (another process took a core, a different
thread count, a slower disk), the policy re-plans with the draft's and the target's costs scaled by those
ratios. Passes without a tree time the target alone; the draft's scale then follows the target's.

Experts: on a mixture read as routed (`PairCosts.expert_reads`), the passes' `experts_routed` and `expert_hits`
re-price the reads a pass pays (`coverage.ExpertWindow`: the distinct experts a tree routed to against the
coverage curve, and the cache's miss rate) and re-plan when either moved by more than `tolerance`.

Measured, not predicted: a `SpeedGuard` (offspec/profile/guard.py) times the planned tree against the target
alone under the current conditions and turns trees off while the target alone is measurably faster. Where the
policy gates suffix candidates (`gate_suffix`), the passes without the planned tree are gated suffix passes
instead of the target alone, and the guard weighs the tree against those; where the plan is a hybrid tree, each
pass weighs them itself instead (`choosing`: the model's tree where the plan expects it to beat the suffix
candidates that pay alone, those where not), so copied code and the prose around it each get their own kind.

Each pass's tree comes from `next_tree()` when `use_tree()` says so, so PassStats.budget shows the budget
in force; `summary()` (also kept in `info.extra["budget_adaptive"]`) shows the scales, the observed vs
predicted acceptance, the guard and the re-plans. When the plan predicts that no tree beats the target
alone (`speculates` is False), auto's passes run without a tree, except where the policy may gate suffix
candidates (`gate_suffix`: the suffix and hybrid drafters; a plan for the suffix drafter alone is always gated):
then each pass proposes the suffix candidates
and keeps only those that pay for their place in the pass under the measured cost model (`pass_cost`,
offspec/spec/gain.py), often none (a plain pass), all of a long copied run. An average acceptance curve says
no tree pays; a copy of code that was given pays every time, and only a per-pass decision sees which is which.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

from offspec.config import PassCost, TreeConfig
from offspec.types import PassStats

from .coverage import ExpertWindow
from .curves import AcceptanceCurve
from .drift import WindowPass, expected_accepted, per_token_keep, ratio_scale
from .guard import GuardConfig, SpeedGuard
from .planner import PairCosts, Plan, PlannerConfig, draft_seconds, plan


@dataclass(frozen=True)
class AdaptConfig:
    window: int = 24  # passes in the running window
    min_passes: int = 8  # passes in the window before the first re-plan
    min_gap: int = 8  # passes between two re-plans
    tolerance: float = 0.2  # relative change of the acceptance scale that is worth a re-plan
    z: float = 2.0  # ... and it must be this many standard errors (not noise)
    min_scale: float = 0.05
    max_scale: float = 8.0
    time_window: int = 16  # timed passes in the timing windows
    time_tolerance: float = 0.3  # relative change of a time scale (median observed / predicted) worth a re-plan
    min_time_scale: float = 0.1
    max_time_scale: float = 50.0


@dataclass(frozen=True)
class Replan:
    at_pass: int  # passes observed when it happened
    budget_from: int
    budget_to: int
    scale: float  # new acceptance scale (observed / profile)
    observed: float  # mean accepted per pass in the window
    predicted: float  # what the profile predicted for the same passes (scale 1)
    reason: str = "acceptance"  # or "timing", "experts"
    keep: float = 1.0  # the per-token drift planned with (AcceptanceCurve.thinned; 1 where the scale is >= 1)
    draft_time_scale: float = 1.0  # observed / predicted draft seconds in force after this re-plan
    target_time_scale: float = 1.0

    def as_dict(self) -> dict:
        return {"at_pass": self.at_pass, "reason": self.reason, "budget_from": self.budget_from,
                "budget_to": self.budget_to, "scale": round(self.scale, 4), "keep": round(self.keep, 4),
                "observed": round(self.observed, 4),
                "predicted": round(self.predicted, 4), "draft_time_scale": round(self.draft_time_scale, 4),
                "target_time_scale": round(self.target_time_scale, 4)}


class AdaptiveBudget:
    """The budget policy of `budget="auto"`: `use_tree()` and `next_tree()` before each pass, `observe()` after."""

    def __init__(self, costs: PairCosts, acceptance: AcceptanceCurve, planner: PlannerConfig = PlannerConfig(),
                 config: AdaptConfig = AdaptConfig(), extra: Optional[dict] = None, key: str = "budget_adaptive",
                 guard: Optional[GuardConfig] = GuardConfig(), gate_suffix: bool = False):
        self.costs, self.acceptance, self.planner, self.config = costs, acceptance, planner, config
        self.gate_suffix = gate_suffix  # suffix candidates may run per pass where the plan has no tree (see above)
        self.gated_passes = self.gated_trees = self.gated_accepted = 0  # passes, those with a tree, tokens taken
        self._gated_pass = False  # the tree of the pass being observed came from the gate
        self._guard_gated = False  # ... because the guard took it instead of the planned tree (gate_suffix)
        self.plan: Plan = plan(costs, acceptance, planner)
        self.initial_plan = self.plan
        self.base_tree = self.plan.tree()  # the generator applies this policy while its `tree` is this object
        self.scale = 1.0  # observed / predicted acceptance in the window of the last acceptance re-plan
        self.keep = 1.0  # ... as a per-token drift (below 1 only): the curve planned with is acceptance.thinned(keep)
        self._thinned: Optional[AcceptanceCurve] = None  # curve_in_force()
        self.window: deque[WindowPass] = deque(maxlen=config.window)  # the recent tree passes
        self.passes = 0  # tree passes observed
        self._last_replan = 0
        self._stop_deferred_until = 0  # tree passes observed when a deferred stop is judged again
        self.replans: list[Replan] = []
        # timing: observed / predicted seconds per pass, and the scales the current plan assumes
        self.draft_ratios: deque[tuple[int, float]] = deque(maxlen=config.time_window)  # (timed pass, ratio)
        self.catch_ups: deque[int] = deque(maxlen=config.window)  # tokens the hybrid's model passes caught up on
        self._unseen = 0  # tokens committed since the last pass that ran the draft model (by passes that did not)
        self.target_ratios: deque[float] = deque(maxlen=config.time_window)
        self.draft_time_scale = self.target_time_scale = 1.0
        self.timed_passes = 0  # passes with times (tree or not)
        self._last_timing_replan = 0
        self.guard = SpeedGuard(guard) if guard is not None else None  # None: trust the plan alone (tests)
        self.experts = (ExpertWindow(costs.expert_reads, config.window, config.min_passes, config.tolerance)
                        if costs.expert_reads is not None else None)  # a mixture read as routed: re-priced online
        self.extra = extra  # a dict (the generator's info.extra) where `summary()` is kept up to date, under `key`
        self.key = key
        self._publish()

    @property
    def tree(self) -> TreeConfig:
        return self.plan.tree()

    @property
    def speculates(self) -> bool:
        """False: the plan predicts no tree beats the target alone, so passes run without a tree. Timing drift
        can re-plan it back (the target's times are still observed); a fixed --budget still speculates."""
        return self.plan.speculates

    @property
    def gated(self) -> bool:
        """Passes propose suffix candidates cut to what pays (see the module doc): the plan has no tree, or its
        tree is the suffix drafter's alone. Its acceptance curve is an average over prompts that copy little
        or much (flat past a few nodes on the calibration prompts), while the per-pass cut sees each match:
        on streamed code edits the planned 4 nodes took 1.69 tokens per pass where the cut takes more."""
        return self.gate_suffix and (not self.plan.speculates or self.plan.best.drafter == "suffix")

    @property
    def choosing(self) -> bool:
        """Each hybrid pass chooses between the model's tree and the suffix candidates that pay on their own, by
        the plan's expectation of the one and the pass cost of the other (`TreeConfig.model_expectation`): the plan
        is a hybrid tree and this policy gates suffix candidates. The measured speeds then decide pass by pass, so
        the SpeedGuard (which weighs one kind of pass against the other over many) stands aside."""
        return self.gate_suffix and self.plan.speculates and self.plan.best.drafter == "hybrid"

    def use_tree(self) -> bool:
        """Whether the next pass grows a tree: the plan says so and the measured speeds agree (SpeedGuard).
        Where a re-plan (measured times) turned trees off, a tree is still probed now and then, so that the
        draft's time gets measured again; a plan that never had trees (the profile's) is trusted. Gated
        suffix passes always propose (the candidates that do not pay are dropped, all of them if need be)."""
        self._gated_pass = False  # set again by next_tree(): a pass that never reached observe() leaves nothing behind
        self._guard_gated = False
        if self.gated or self.choosing:
            return True
        if self.guard is None:
            return self.plan.speculates
        if not self.plan.speculates and not self.replans:
            return False
        if self.guard.wants_tree(planned=self.plan.speculates):
            return True
        self._guard_gated = self.gate_suffix  # not the planned tree: a gated suffix pass where this drafter can
        return self._guard_gated

    def pass_cost(self, nodes: int) -> PassCost:
        """The target pass's cost model under the current timing scale, for up to `nodes` tree nodes: the measured
        pass times at the sizes measured (a pass of k tokens verifies k - 1 nodes), up to `nodes`; on a mixture read
        as routed, with the expert reads each size pays."""
        costs = self.costs.scaled(target=self.target_time_scale)
        reads = costs.expert_seconds  # 0 where none are priced
        base = costs.target_pass(1) + reads(1)
        sizes = [k - 1 for k, _ in costs.target_pass.points if 1 < k <= nodes] + [nodes]
        measured = tuple((n, max(0.0, costs.target_pass(1 + n) + reads(1 + n) - base))
                         for n in [0, *sorted(set(sizes))])
        return PassCost(base=base, per_node=measured[-1][1] / nodes, head=costs.target_head, measured=measured,
                        head_rows=costs.head_rows)

    def next_tree(self, base: TreeConfig) -> TreeConfig:
        """The tree for the next pass: the planned budget, beams, depth and drafter; the branch stays the caller's.
        Gated: the suffix drafter alone, up to `confident_budget` candidates, cut to what pays."""
        self._gated_pass = self.gated or self._guard_gated
        if self._gated_pass:
            nodes = max(1, min(base.confident_budget or base.budget, self.planner.max_budget))
            return replace(base, budget=nodes, confident_budget=nodes, max_depth=nodes, drafter="suffix",
                           pass_cost=self.pass_cost(nodes))  # a chain as deep as the nodes: copies run long
        best = self.plan.best
        cost = self.pass_cost(max(best.budget, base.confident_budget)) if self.gate_suffix else None
        expectation = None
        if self.choosing:
            costs = self.costs.scaled(draft=self.draft_time_scale, target=self.target_time_scale)
            draft = draft_seconds(costs, self.acceptance, best.budget, best.max_beams, best.max_depth, "model")
            expectation = (best.accepted, draft + self._catch_up_seconds(costs))
        return replace(base, budget=best.budget, max_beams=best.max_beams, max_depth=best.max_depth,
                       drafter=best.drafter, pass_cost=cost, model_expectation=expectation)

    def _catch_up_seconds(self, costs: PairCosts) -> float:
        """What a hybrid pass with the model's tree pays on average, past the 2 tokens the plan counts, for the
        tokens committed by the passes that did not run the model (their debt: the draft sees every token before
        it grows a tree). Averaged over the recent model passes (`catch_ups`), not this pass's own lag: the debt
        is owed whichever pass pays it, and a pass that weighed its own lag would leave a draft that fell far
        behind (a long copy) behind for good."""
        if not self.catch_ups or costs.draft_step is None:
            return 0.0
        step = costs.draft_step
        return statistics.fmean(max(0.0, step(c) - step(2)) for c in self.catch_ups)

    def _expected_accepted(self, budget: int, depth: Optional[int] = None, curve: Optional[AcceptanceCurve] = None,
                           scale: float = 1.0) -> float:
        """`drift.expected_accepted` under `curve` (the profile's) and the plan's depth cap unless given."""
        return expected_accepted(curve or self.acceptance, budget, self.plan.best.max_depth if depth is None else depth,
                                 scale)

    def curve_in_force(self) -> AcceptanceCurve:
        """The acceptance curve the current plan assumes (before its uniform scale, `_plan_scale`)."""
        return self._curve(self.keep)

    def _curve(self, keep: float) -> AcceptanceCurve:
        """The profile's curve thinned by `keep` (itself at 1); the last one is kept: its values are memoized."""
        if self._thinned is None or self._thinned.keep != keep:
            self._thinned = self.acceptance.thinned(keep) if keep < 1.0 else self.acceptance
        return self._thinned

    def _plan_scale(self) -> float:
        return 1.0 if self.keep < 1.0 else self.scale

    def observe(self, stats: PassStats) -> None:
        """One pass's statistics: a tree pass (tree_size > 0) or a pass of the target alone."""
        if self.experts is not None and self.experts.observe(stats.tree_size, stats.experts_routed, stats.expert_hits):
            self.costs = replace(self.costs, expert_reads=self.experts.reads)  # the pricing in force
            self._replan("experts")
        if stats.drafter in ("model", "hybrid") and stats.caught_up > 0:  # the draft model ran
            if stats.drafter == "hybrid":  # a conversation's prompt is no debt of the passes: only their tokens
                self.catch_ups.append(min(stats.caught_up, 2 + self._unseen))
            self._unseen = 0
        else:
            self._unseen += stats.emitted
        if self._gated_pass:
            self._gated_pass = False
            self._observe_gated(stats)
            if self._guard_gated and (stats.draft_seconds > 0 or stats.target_seconds > 0):
                self.guard.observe_plain(stats.draft_seconds + stats.target_seconds, 1.0 + stats.accepted)
            self._guard_gated = False
            self._publish()
            return
        if self.choosing and stats.drafter == "suffix":  # the hybrid pass chose the suffix candidates alone: its
            self._observe_gated(stats)  # acceptance is the suffix drafter's (not the curve's), its time the target's
            self._publish()
            return
        budget = stats.budget + stats.grown_nodes  # a tree grown while the weights loaded counts as its own size
        if stats.tree_size > budget > 0:  # a confident suffix pass beyond the budget
            return  # (TreeConfig.confident_budget): the acceptance curve and the timing model are per budget
        tree = stats.tree_size > 0
        if tree:
            depth = self.plan.best.max_depth
            self.window.append(WindowPass(stats.accepted, self._expected_accepted(budget, depth), budget, depth))
            self.passes += 1
            if len(self.window) >= self.config.min_passes and self.passes - self._last_replan >= self.config.min_gap:
                self._maybe_replan()
        if stats.draft_seconds > 0 or stats.target_seconds > 0:  # zero times: not measured (scripted passes)
            self._observe_times(stats, tree)
        self._publish()

    # -- timing -------------------------------------------------------------------------------

    def _observe_times(self, stats: PassStats, tree: bool) -> None:
        best, costs = self.plan.best, self.costs  # the profile's costs: ratios are against scale 1
        if tree:
            drafter = best.drafter  # the drafter this policy plans for (suffix: no model step)
            if drafter == "hybrid":  # this pass's own draft: the model's tree grown (or not: a confident copy)
                drafter = "suffix" if stats.drafter == "suffix" else "model"
            draft = draft_seconds(costs, self.acceptance, stats.budget, best.max_beams, best.max_depth, drafter)
            if drafter != "suffix" and stats.caught_up > 2 and costs.draft_step is not None:
                # the draft's cache lagged (a prompt, or passes that ran no model): its first forward took more
                # tokens than the 2 the model counts, which says nothing about the draft's speed
                draft += costs.draft_step(stats.caught_up) - costs.draft_step(2)
            target = (costs.target_pass(stats.tree_size + 1) + costs.head_seconds(1 + stats.accepted)
                      + costs.expert_seconds(stats.tree_size + 1))
            beyond = costs.draft_step is not None and stats.caught_up > costs.draft_step.largest  # a prompt's catch-up:
            # extrapolated past the sizes timed (a 150-token forward of the default draft took 1.55x the straight
            # line through its 8- and 64-node steps), it would be taken for a slower draft
            grown = stats.grown_nodes > 0  # it drafted on while the weights loaded: its time is the reads', not its own
            if draft > 0 and (drafter != "suffix" or best.drafter == "suffix") and not beyond and not grown:
                self.draft_ratios.append((self.timed_passes, stats.draft_seconds / draft))  # the model's own time
            if self.guard is not None:
                expected = 1.0 + self._expected_accepted(stats.budget + stats.grown_nodes, curve=self.curve_in_force(),
                                                         scale=self._plan_scale())
                self.guard.observe_tree(stats.draft_seconds + stats.target_seconds, expected)
        else:
            target = costs.autoregressive_seconds()
            if self.guard is not None:
                self.guard.observe_plain(stats.target_seconds)
        self._time_target(stats.target_seconds, target)

    def _observe_gated(self, stats: PassStats) -> None:
        """A gated suffix pass: its target time against the cost model (timing drift re-plans as usual);
        its acceptance is the suffix drafter's own business (it learns q(m)), not the plan's curve."""
        self.gated_passes += 1
        self.gated_trees += stats.tree_size > 0
        self.gated_accepted += stats.accepted
        if stats.target_seconds <= 0:  # not measured (scripted passes)
            return
        costs = self.costs
        self._time_target(stats.target_seconds, costs.target_pass(stats.tree_size + 1)
                          + costs.head_seconds(1 + stats.accepted) + costs.expert_seconds(stats.tree_size + 1))

    def _time_target(self, observed: float, predicted: float) -> None:
        """One timed pass: the target's observed / predicted seconds join the window, which may re-time."""
        if predicted > 0:
            self.target_ratios.append(observed / predicted)
        self.timed_passes += 1
        if (len(self.target_ratios) >= self.config.min_passes
                and self.timed_passes - self._last_timing_replan >= self.config.min_gap):
            self._maybe_retime()

    def _maybe_retime(self) -> None:
        cfg = self.config
        target = statistics.median(self.target_ratios)
        recent = [r for at, r in self.draft_ratios if at > self.timed_passes - cfg.time_window]
        if len(recent) >= cfg.min_passes:
            draft = statistics.median(recent)
        elif recent:  # a few tree probes: the median of what they measured
            draft = statistics.median(recent)
            if abs(draft / self.draft_time_scale - 1) <= cfg.time_tolerance:
                draft = self.draft_time_scale
        else:  # no recent trees: the draft is assumed to have slowed or sped up like the target
            draft = self.draft_time_scale * target / self.target_time_scale
        moved = [abs(new / old - 1) > cfg.time_tolerance
                 for new, old in ((draft, self.draft_time_scale), (target, self.target_time_scale))]
        if not any(moved):
            return
        clamp = lambda x: min(cfg.max_time_scale, max(cfg.min_time_scale, x))  # noqa: E731
        self.draft_time_scale, self.target_time_scale = clamp(draft), clamp(target)
        self._last_timing_replan = self.timed_passes
        self._replan("timing")

    def reset_timing(self) -> None:
        """Forget the timing windows (e.g. the thread count changed); the next passes measure afresh."""
        self.draft_ratios.clear()
        self.target_ratios.clear()
        self._last_timing_replan = self.timed_passes
        if self.guard is not None:
            self.guard.reset()

    # -- acceptance ---------------------------------------------------------------------------

    def observed_scale(self) -> tuple[float, float]:
        """(scale, standard error) from the window (`drift.ratio_scale`); the scale in force where it has none."""
        return ratio_scale(self.window) or (self.scale, math.inf)

    def observed_keep(self) -> float:
        """The per-token drift of the window (`drift.per_token_keep`, no less than `min_scale`)."""
        return per_token_keep(self.window, self.acceptance, self.config.min_scale)

    def _maybe_replan(self) -> None:
        if self.passes < self._stop_deferred_until:
            return  # a stop waits for its full window (below): no plan to search on each pass until then
        r, se = self.observed_scale()
        change = abs(r - self.scale)
        if change <= self.config.tolerance * self.scale or change <= self.config.z * se:
            return
        scale = min(self.config.max_scale, max(self.config.min_scale, r))
        keep = self.observed_keep() if scale < 1.0 else 1.0
        candidate = self._plan_with(scale, keep)
        if self.plan.speculates and not candidate.speculates and len(self.window) < self.config.window:
            self._stop_deferred_until = self.passes + self.config.window - len(self.window)
            return  # stopping trees needs a full window (see the module doc)
        self.scale, self.keep = scale, keep
        self._last_replan = self.passes
        self._replan("acceptance", candidate)

    def _plan_with(self, scale: float, keep: float) -> Plan:
        costs = self.costs.scaled(draft=self.draft_time_scale, target=self.target_time_scale)
        thinned = keep < 1.0  # the drift is in the curve; the plan still reports the observed scale
        found = plan(costs, self._curve(keep), self.planner, acceptance_scale=1.0 if thinned else scale)
        return replace(found, acceptance_scale=scale)

    def _replan(self, reason: str, new: Optional[Plan] = None) -> None:
        old = self.plan.best.budget
        self.plan = new if new is not None else self._plan_with(self.scale, self.keep)
        if self.guard is not None and self.plan.best.budget != old:
            self.guard.forget_trees()
        n = len(self.window)
        observed = sum(w.accepted for w in self.window) / n if n else 0.0
        predicted = sum(w.predicted for w in self.window) / n if n else 0.0
        self.replans.append(Replan(self.passes, old, self.plan.best.budget, self.scale, observed, predicted,
                                   reason, self.keep, self.draft_time_scale, self.target_time_scale))

    def summary(self) -> dict:
        n = len(self.window)
        return {"drafter": self.plan.best.drafter, "budget": self.plan.best.budget,
                "max_beams": self.plan.best.max_beams,
                "max_depth": self.plan.best.max_depth, "acceptance_scale": round(self.scale, 4),
                "acceptance_keep": round(self.keep, 4),
                "observed_accepted": round(sum(w.accepted for w in self.window) / n, 4) if n else None,
                "predicted_accepted": round(sum(self._expected_accepted(w.budget, w.depth, self.curve_in_force(),
                                                                        self._plan_scale()) for w in self.window) / n,
                                            4) if n else None,
                "predicted_tokens_per_second": round(self.plan.best.tokens_per_second, 4),
                "draft_time_scale": round(self.draft_time_scale, 4),
                "target_time_scale": round(self.target_time_scale, 4),
                "speculate": self.speculates,
                "gated_suffix": self.gated or (self.gate_suffix and self.guard is not None and not self.guard.trees_on),
                "gated": {"passes": self.gated_passes, "with_tree": self.gated_trees, "accepted": self.gated_accepted},
                "guard": self.guard.summary() if self.guard is not None else None,
                "passes_observed": self.passes, "replans": [e.as_dict() for e in self.replans[-10:]],
                **({"experts": self.experts.summary()} if self.experts is not None else {})}

    def _publish(self) -> None:
        if self.extra is not None:
            self.extra[self.key] = self.summary()
