"""The planner: the tree shape (budget, max_beams, max_depth) that maximizes expected tokens per second.

    tokens/s(B, w, d) = (1 + accepted(B, d)) / (draft(B, w, d) + target(B))

- accepted(B, d): mean accepted draft tokens per pass (the pass also emits one token of the target's own);
- target(B) = pass(B + 1 tokens) + head(1 + accepted): one forward over the root and the B nodes, then
  the acceptance walk computes the LM head on every node of the accepted path and the bonus position (one call for
  up to `head_rows` of them where the head is row-invariant, else a call each: `PairCosts.head_seconds`); a pass (and
  a draft step) is never faster than its tokens' matrix products at the device's usable FLOP/s (the FLOP term:
  past the sizes measured, a curve extrapolates, and a flat, link-bound curve would extrapolate flat);
- draft(B, w, d) = step(2) + steps * step(w): the catch-up of the new tokens and the root's children, then
  `steps` batched forwards of w nodes. Growth expands about every node that ends in the tree
  (`expand_ratio` * B nodes, measured) and each step goes at most one level deeper, so
  steps = max(depth(B, d), ceil(expand_ratio * B / w)). Where whole-tree draft times were measured (at
  the automatic beams), the model is scaled to them, budget by budget.

A mixture whose experts are read as routed (`PairCosts.expert_reads`, offspec/profile/coverage.py) pays its
misses on top: target(B) adds `ExpertReads.seconds(B + 1)`, which grows with the distinct experts the tree's
tokens route to, and the target alone pays `seconds(1)`. Where that is what leaves no tree paying (the best tree
would beat the target alone without its reads), the plan says so (`Plan.no_tree_reason`). Without it (a dense
model, a resident mixture) the plan is what it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from offspec.config import DRAFTERS, TreeConfig, head_calls
from offspec.errors import OffspecError

from .coverage import CoverageCurve, ExpertReads, no_tree_note
from .curves import AcceptanceCurve, CostCurve
from .drift import expected_accepted

# Candidate tree shapes, in one place. Budgets: about 1.5x apart, so the best grid point is within ~20%
# of the best budget; tokens/s is flat near its optimum, so this costs little.
BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
BEAMS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEPTHS = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class PlannerConfig:
    budgets: tuple[int, ...] = BUDGETS
    beams: tuple[int, ...] = BEAMS
    depths: tuple[int, ...] = DEPTHS
    branch: int = TreeConfig.branch  # children per expanded node (not planned: calibration used this value)
    max_budget: int = 4096  # the engine's cap (LoadConfig.max_budget)
    drafter: str = "model"  # model, suffix or hybrid: the drafter planned for (its acceptance curve is given)


@dataclass(frozen=True)
class PairCosts:
    """Measured (or projected) costs of the target and the draft under the current placement."""

    target_pass: CostCurve  # tokens in one target forward -> seconds
    target_head: float  # seconds of the LM head + token choice, per call (one call per position where head_rows is 1)
    draft_step: Optional[CostCurve]  # nodes expanded in one batched draft step -> seconds; None: no draft model
    draft_propose: Optional[CostCurve] = None  # budget -> seconds to grow a whole tree at the automatic beams
    expand_ratio: float = 1.0  # draft nodes expanded per tree node (growth also expands nodes trimmed later)
    calibration_depth: int = 64  # max_depth the whole-tree draft times were measured with
    suffix_seconds: float = 0.0  # one suffix proposal (index lookup and candidate tree), per pass
    # seconds per token of a pass's matrix products at the device's usable FLOP/s: no pass past the measured sizes
    # is faster than its tokens times this (the FLOP term: measured curves stop at some size; 0 = none known)
    target_flop_seconds: float = 0.0
    draft_flop_seconds: float = 0.0
    # walk positions one LM-head call covers: the engine computes the walk's likely rows in one call where the head
    # gives a row the same bits whatever the batch (offspec's CPU kernels: 4, one read of the head's weights for
    # 1.0-1.25x the seconds of one row); 1 elsewhere (a head call per position)
    head_rows: int = 1
    expert_reads: Optional[ExpertReads] = None  # a mixture read as routed: what its misses add to a pass

    def expert_seconds(self, tokens: int) -> float:
        """Seconds a target pass of `tokens` tokens waits on expert reads (0 where none are priced)."""
        return self.expert_reads.seconds(tokens) if self.expert_reads is not None else 0.0

    def head_seconds(self, positions: float) -> float:
        """The LM head's seconds over a walk of `positions` positions (the accepted path and the bonus)."""
        return self.target_head * head_calls(positions, self.head_rows)

    def autoregressive_seconds(self) -> float:
        if self.expert_reads is None:
            return self.target_pass_seconds(1) + self.target_head
        return self.target_pass_seconds(1) + self.target_head + self.expert_seconds(1)

    def target_pass_seconds(self, tokens: int) -> float:
        """One target pass of `tokens` tokens: the measured curve; past its largest size, never under the FLOP term."""
        return _floored(self.target_pass, tokens, self.target_flop_seconds)

    def draft_step_seconds(self, nodes: int) -> float:
        """One draft step expanding `nodes` nodes: the measured curve; past its largest size, never under the FLOP
        term."""
        return _floored(self.draft_step, nodes, self.draft_flop_seconds)

    def scaled(self, draft: float = 1.0, target: float = 1.0) -> "PairCosts":
        """These costs with every draft time times `draft` and every target time times `target`."""
        return replace(self, target_pass=self.target_pass.scaled(target), target_head=self.target_head * target,
                       draft_step=self.draft_step.scaled(draft) if self.draft_step else None,
                       draft_propose=self.draft_propose.scaled(draft) if self.draft_propose else None,
                       suffix_seconds=self.suffix_seconds * draft, target_flop_seconds=self.target_flop_seconds * target,
                       draft_flop_seconds=self.draft_flop_seconds * draft,
                       expert_reads=self.expert_reads.scaled(target) if self.expert_reads is not None else None)


def _floored(curve: CostCurve, n: int, per_unit: float) -> float:
    """curve(n) where it was measured; past its largest size, at least n * per_unit (the measurements stand where
    they exist: the FLOP term only bounds the extrapolation)."""
    if n <= curve.largest:
        return curve(n)
    return max(curve(n), n * per_unit)


@dataclass(frozen=True)
class PlanPoint:
    budget: int
    max_beams: int
    max_depth: int
    accepted: float  # mean accepted draft tokens per pass
    draft_seconds: float
    target_seconds: float
    drafter: str = "model"

    @property
    def tokens_per_pass(self) -> float:
        return 1.0 + self.accepted

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.target_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_pass / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"budget": self.budget, "max_beams": self.max_beams, "max_depth": self.max_depth,
                "drafter": self.drafter, "accepted": round(self.accepted, 4), "draft_seconds": round(self.draft_seconds, 6),
                "target_seconds": round(self.target_seconds, 6), "tokens_per_second": round(self.tokens_per_second, 4)}


@dataclass(frozen=True)
class Plan:
    best: PlanPoint
    curve: tuple[PlanPoint, ...]  # the best shape at each candidate budget, budgets increasing
    autoregressive_tokens_per_second: float
    branch: int = TreeConfig.branch
    acceptance_scale: float = 1.0  # 1 = the curve as measured; online adaptation re-plans with other scales
    notes: tuple[str, ...] = field(default=())
    expert_reads: Optional[ExpertReads] = None  # the expert reads priced (a mixture read as routed)
    no_tree_reason: str = ""  # where no tree pays because of the experts it touches: why (no_tree_note)
    coverage: Optional[CoverageCurve] = None  # a mixture's coverage curve, priced or not (reported)

    @property
    def speedup(self) -> float:
        ar = self.autoregressive_tokens_per_second
        return self.best.tokens_per_second / ar if ar > 0 else 0.0

    @property
    def speculates(self) -> bool:
        """False when no tree is predicted to beat the target alone: `--budget auto` then decodes without one."""
        return self.best.tokens_per_second > self.autoregressive_tokens_per_second

    def tree(self) -> TreeConfig:
        return TreeConfig(budget=self.best.budget, max_beams=self.best.max_beams, branch=self.branch,
                          max_depth=self.best.max_depth, drafter=self.best.drafter)

    def at(self, budget: int) -> PlanPoint:
        """The curve's point nearest to `budget` (in log scale)."""
        return min(self.curve, key=lambda p: abs(math.log(p.budget) - math.log(max(budget, 1))))

    def summary(self) -> dict:
        reason = {"no_tree_reason": self.no_tree_reason} if self.no_tree_reason else {}
        return {**self.best.as_dict(), "branch": self.branch,
                "predicted_tokens_per_second": round(self.best.tokens_per_second, 4),
                "autoregressive_tokens_per_second": round(self.autoregressive_tokens_per_second, 4),
                "predicted_speedup": round(self.speedup, 4), "acceptance_scale": round(self.acceptance_scale, 4),
                "speculate": self.speculates, **reason}


def auto_beams(budget: int) -> int:
    """The engine's automatic beams for a budget (TreeConfig.beams with max_beams=0)."""
    return TreeConfig(budget=budget).beams


def _model_draft(costs: PairCosts, acceptance: AcceptanceCurve, budget: int, beams: int, depth: int) -> float:
    w = max(1, min(beams, budget))
    steps = max(min(float(depth), acceptance.depth(budget)), math.ceil(costs.expand_ratio * budget / w))
    return costs.draft_step_seconds(2) + steps * costs.draft_step_seconds(w)


def draft_seconds(costs: PairCosts, acceptance: AcceptanceCurve, budget: int, beams: int, depth: int,
                  drafter: str = "model") -> float:
    if drafter == "suffix":
        return costs.suffix_seconds
    model = _model_tree_seconds(costs, acceptance, budget, beams, depth)
    return model if drafter == "model" else costs.suffix_seconds + acceptance.model_share * model


def _model_tree_seconds(costs: PairCosts, acceptance: AcceptanceCurve, budget: int, beams: int, depth: int) -> float:
    modelled = _model_draft(costs, acceptance, budget, beams, depth)
    if costs.draft_propose is None:
        return modelled
    # scale the model to the measured whole-tree time at this budget (automatic beams, calibration depth); past the
    # largest budget measured, by the ratio there (the model's growth, not a straight line through two tree times)
    at = min(budget, costs.draft_propose.largest)
    reference = _model_draft(costs, acceptance, at, auto_beams(at), costs.calibration_depth)
    scale = costs.draft_propose(at) / reference if reference > 0 else 1.0
    return modelled * min(4.0, max(0.25, scale))


def evaluate(costs: PairCosts, acceptance: AcceptanceCurve, budget: int, beams: int, depth: int,
             acceptance_scale: float = 1.0, drafter: str = "model") -> PlanPoint:
    accepted = expected_accepted(acceptance, budget, depth, acceptance_scale)
    target = costs.target_pass_seconds(budget + 1) + costs.head_seconds(1.0 + accepted)
    if costs.expert_reads is not None:
        target += costs.expert_seconds(budget + 1)
    return PlanPoint(budget=budget, max_beams=beams, max_depth=depth, accepted=accepted,
                     draft_seconds=draft_seconds(costs, acceptance, budget, beams, depth, drafter),
                     target_seconds=target, drafter=drafter)


def plan(costs: PairCosts, acceptance: AcceptanceCurve, config: PlannerConfig = PlannerConfig(),
         acceptance_scale: float = 1.0) -> Plan:
    """Search every candidate (budget, beams, depth); ties go to the smaller budget, beams and depth."""
    budgets = [b for b in config.budgets if b <= config.max_budget]
    if not budgets:
        raise OffspecError(f"no candidate budget fits max_budget {config.max_budget}; raise max_budget")
    if config.drafter not in DRAFTERS:
        raise OffspecError(f"unknown drafter {config.drafter!r}; use {', '.join(DRAFTERS)}")
    if config.drafter != "suffix" and costs.draft_step is None:
        raise OffspecError(f"the {config.drafter} drafter needs draft model timings, and these costs have none")
    # depth caps change acceptance only where per-pass samples say by how much; else keep the engine's default
    depths = list(config.depths) if acceptance.samples else [TreeConfig.max_depth]
    curve = []
    for b in budgets:
        best_here: Optional[PlanPoint] = None
        # beams shape the model's growth; the suffix drafter has none (its passes use the automatic value)
        widths = sorted({min(w, b) for w in config.beams} | {auto_beams(b)})
        if config.drafter == "suffix":
            widths = [auto_beams(b)]
        for w in widths:
            for d in depths:
                point = evaluate(costs, acceptance, b, w, d, acceptance_scale, config.drafter)
                if best_here is None or point.tokens_per_second > best_here.tokens_per_second * (1 + 1e-9):
                    best_here = point
        curve.append(best_here)
    best = curve[0]
    for point in curve[1:]:
        if point.tokens_per_second > best.tokens_per_second * (1 + 1e-9):
            best = point
    notes = []
    if best.budget >= acceptance.largest and best.budget < config.max_budget:
        notes.append(f"the best budget is at the edge of the measured acceptance curve ({acceptance.largest}); "
                     f"a profile with bigger trees may find a better one")
    ar = 1.0 / costs.autoregressive_seconds()
    reason = _experts_reason(costs, best) if best.tokens_per_second <= ar else ""
    if reason:
        notes.append(f"no tree beats the target alone on this set-up: {reason}; --budget auto decodes with the "
                     f"target alone")
    elif best.tokens_per_second <= ar:
        gate = ("" if config.drafter == "model" else
                ", except in passes where suffix candidates pay for their place (a long copy of text seen before)")
        notes.append(f"no tree beats the target alone on this set-up (the {config.drafter} drafter is too slow or "
                     f"accepts too little on average); --budget auto decodes with the target alone{gate}")
    return Plan(best=best, curve=tuple(curve), autoregressive_tokens_per_second=ar, branch=config.branch,
                acceptance_scale=acceptance_scale, notes=tuple(notes), expert_reads=costs.expert_reads,
                no_tree_reason=reason, coverage=costs.expert_reads.coverage if costs.expert_reads else None)


def _experts_reason(costs: PairCosts, best: PlanPoint) -> str:
    """Why no tree pays where the expert reads are the reason (the best tree, without its reads and the target
    alone without its own, would beat the target alone); "" elsewhere."""
    reads = costs.expert_reads
    if reads is None or not reads.priced:
        return ""
    alone = costs.autoregressive_seconds()
    tree_seconds = best.seconds - costs.expert_seconds(best.budget + 1)
    if tree_seconds <= 0 or best.tokens_per_pass / tree_seconds <= 1.0 / (alone - costs.expert_seconds(1)):
        return ""
    return no_tree_note(reads, best.budget, best.accepted, alone)
