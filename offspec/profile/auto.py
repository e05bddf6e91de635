"""`budget="auto"`: plan the tree at load time, then adapt it while generating.

1. A measured profile whose fingerprint matches this machine, model pair and placement (saved by
   `offspec profile` in the config dir): its timings and acceptance curve.
2. Otherwise a start-up estimate: a few timed target passes and draft steps on the loaded models
   (seconds), with the acceptance prior that ships with offspec (`offspec/data/acceptance_prior.json`).

Either way the planner picks the tree, an `AdaptiveBudget` policy re-plans it from the acceptance it
observes, and `info.extra` says what the choice was based on (`budget_source`, `budget_basis`,
`budget_plan`, `budget_adaptive`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from typing import Any, Optional

from ..progress import ProgressEvent, ProgressFn, no_progress
from .adapt import AdaptiveBudget
from .curves import AcceptanceCurve, CostCurve
from .hardware import identity
from .planner import PairCosts, PlannerConfig
from .schema import ACCEPTANCE_FILE_SCHEMA, validate
from .store import acceptance_of, costs_of, find_profile, load_profile, profile_key
from .timing import PassTimer, SweepConfig, sweep

# The start-up estimate: few sizes, one call each, a hard time cap (the load's warm-up already ran).
ESTIMATE_TARGET = SweepConfig(sizes=(1, 16, 128, 1024, 4096), repeats=1, max_call_seconds=0.6,
                              max_total_seconds=3.0, warmup=False, compute_bound_steps=1, probe=False)
ESTIMATE_DRAFT = SweepConfig(sizes=(1, 8, 64), repeats=1, max_call_seconds=0.3, max_total_seconds=1.5, warmup=False,
                             compute_bound_steps=1, probe=False)
ESTIMATE_CONTEXT = "Write a short Python function that adds two numbers, then explain it in one sentence."


def pair_key(generator, load_cfg: Any) -> dict:
    """The fingerprint key of a loaded generator: hardware, model pair (names, dtype, quantization), placement."""
    info = generator.info
    models = {"target": info.target, "draft": info.draft, "dtype": info.dtype,
              "quant": getattr(load_cfg, "quant", "none"), "draft_quant": getattr(load_cfg, "draft_quant", "none")}
    return profile_key(identity(generator.engine.target.device), models, info.extra.get("placement"))


def prior_acceptance() -> tuple[AcceptanceCurve, str]:
    """The acceptance curve assumed before this pair is measured, with where it comes from."""
    text = resources.files("offspec").joinpath("data/acceptance_prior.json").read_text(encoding="utf-8")
    data = validate(json.loads(text), "offspec/data/acceptance_prior.json", ACCEPTANCE_FILE_SCHEMA)
    pair = data["acceptance"].get("pair", "the default pair")
    return acceptance_of(data, "acceptance prior"), f"prior curve measured with {pair}"


def estimate_costs(generator, progress: ProgressFn = no_progress) -> tuple[PairCosts, str]:
    """A few timed passes on the loaded models (caches are left empty). Returns the costs and what they were."""
    engine = generator.engine
    draft = engine.drafter.runner
    timer = PassTimer(engine.target, draft, generator.tree.branch)
    try:
        context = generator.encode(ESTIMATE_CONTEXT)[-max(1, engine.max_context // 2):]  # fits any context limit
        engine.reset_to(context)
        draft.extend(context[draft.length :])
        room = engine.target.capacity - engine.target.length
        target_cfg = replace(ESTIMATE_TARGET, largest=min(engine.max_budget + 1, room))
        target_points, _ = sweep(timer.target_pass, engine.target.device, target_cfg, "estimate",
                                 "estimating the tree budget: target passes", progress)
        draft_cfg = replace(ESTIMATE_DRAFT, largest=min(max(1, engine.max_budget), draft.capacity - draft.length))
        draft_points, _ = sweep(timer.draft_step, draft.device, draft_cfg, "estimate",
                                "estimating the tree budget: draft steps", progress)
        head = timer.head(repeats=2)
    finally:
        engine.tokens = []
        engine.target.cache.truncate(0)
        draft.cache.truncate(0)
    shown = ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in target_points)
    detail = (f"target passes timed at start-up ({shown} by tokens), draft steps at "
              f"{', '.join(str(n) for n, _ in draft_points)} nodes")
    return PairCosts(target_pass=CostCurve.of(target_points), target_head=head, draft_step=CostCurve.of(draft_points),
                     expand_ratio=1.0), detail


def apply_auto_budget(generator, load_cfg: Any, progress: Optional[ProgressFn] = None) -> AdaptiveBudget:
    """Plan the tree of a freshly loaded generator and attach the adaptive policy (see the module doc)."""
    progress = progress or no_progress
    progress(ProgressEvent("budget", "choosing the tree budget", 0, 1))
    path = find_profile(pair_key(generator, load_cfg))
    if path is not None:
        data = load_profile(path)
        costs, acceptance = costs_of(data, str(path)), acceptance_of(data, str(path))
        quick = ", quick" if data.get("quick") else ""
        source, basis = "profile", f"measured profile {path} ({data.get('created', 'undated')}{quick})"
    else:
        costs, detail = estimate_costs(generator, progress)
        acceptance, prior = prior_acceptance()
        source = "estimate"
        basis = f"start-up estimate: {detail}; acceptance: {prior}; run `offspec profile` to measure this pair"
    planner = PlannerConfig(branch=generator.tree.branch, max_budget=generator.engine.max_budget)
    policy = AdaptiveBudget(costs, acceptance, planner, extra=generator.info.extra)
    generator.tree = policy.base_tree  # a caller that assigns another tree (e.g. bench) gets exactly that tree
    generator.policy = policy
    generator.info = replace(generator.info, default_budget=policy.plan.best.budget)  # `extra` stays the same dict
    generator.info.extra.update(budget_source=source, budget_basis=basis, budget_plan=policy.plan.summary(),
                                budget_profile=str(path) if path else None)
    progress(ProgressEvent("budget", "choosing the tree budget", 1, 1, finished=True))
    return policy
