"""`budget="auto"`: plan the tree at load time, then adapt it while generating.

1. A measured profile whose fingerprint matches this machine, model pair and placement (saved by
   `offspec profile` in the config dir): its timings and acceptance curves.
2. Otherwise a start-up estimate: a few timed target passes and draft steps on the loaded models
   (seconds), with the acceptance measured for this same pair in another set-up's profile (another placement,
   machine or kernel build: acceptance is the pair's, timings are not), else the acceptance prior that ships with
   offspec (`offspec/data/acceptance_prior.json`).

Each drafter (model, suffix, hybrid) has its own acceptance curve, so each available one gets its own
plan and `AdaptiveBudget` policy (the suffix and hybrid ones also gate suffix candidates pass by pass where
the plan has no tree: see `offspec.profile.adapt`): the generator's default drafter is `generator.policy`,
every one is in `generator.policies` (a call with `drafter=` uses that one's). A drafter whose curve the profile lacks
(a profile measured before suffix drafting) takes the prior's. `info.extra` says what the choice was
based on (`budget_source`, `budget_basis`, `budget_plan`, `budget_adaptive`, `budget_adaptive_<drafter>`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from importlib import resources
from typing import Optional

from offspec.config import LoadConfig, TreeConfig
from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.spec.suffix_drafter import SuffixDrafter

from .adapt import AdaptiveBudget
from .coverage import ExpertReads, expert_reads_of
from .curves import AcceptanceCurve, CostCurve
from .hardware import identity
from .measure import CALIBRATION_DEPTH, measure_acceptance
from .planner import PairCosts, PlannerConfig
from .routing import RoutingRecorder, unmissed_read_seconds
from .schema import AcceptanceFile, validate
from .store import (acceptance_curves, acceptance_profiles, costs_of, find_profile, load_profile, profile_key,
                    stale_profiles)
from .timing import PassTimer, SweepConfig, propose_after_a_pass, sweep, timed

# The start-up estimate: few sizes, one call each, a hard time cap (the load's warm-up already ran).
# Target passes at 2-8 tokens too: the pass cost of a few tree nodes decides per-pass suffix drafts (offspec/spec/gain.py),
# and on a CPU with tile kernels it is nowhere near a straight line through 1 and 16.
# A streamed target whose passes pass max_call_seconds while still flat is probed at sizes 8x apart (one call each):
# without it, two noisy points (a 2-token pass timed 40% slower than a 1-token one, the disk having slowed) were
# extrapolated into a per-token cost that planned 3-node trees for a pass that costs the same for 64.
ESTIMATE_TARGET = SweepConfig(sizes=(1, 2, 4, 8, 16, 128, 1024, 4096), repeats=1, max_call_seconds=0.6,
                              max_total_seconds=3.0, warmup=False, compute_bound_steps=1, probe=True)
ESTIMATE_DRAFT = SweepConfig(sizes=(1, 8, 64), repeats=1, max_call_seconds=0.3, max_total_seconds=1.5, warmup=False,
                             compute_bound_steps=1, probe=False)
ESTIMATE_CONTEXT = "Write a short Python function that adds two numbers, then explain it in one sentence."
# Whole-tree draft growth at small budgets, while the start-up's time allows: what a tree of a few nodes costs (one
# forward for a budget of 1) is measured, not modelled from single steps (which charge a chain one draft step too many).
ESTIMATE_PROPOSE = (1, 2, 4, 8, 16, 32, 64)
ESTIMATE_PROPOSE_SECONDS = 1.5
# A mixture whose experts are read as routed: the expert coverage of a few draft trees verified at start-up (the
# experts their tokens route to, the cache's misses and their wait), as `offspec profile` measures it on more passes
ESTIMATE_EXPERT_BUDGETS = (1, 4, 16, 64)
ESTIMATE_EXPERT_PASSES = 2


def pair_key(generator, load_cfg: LoadConfig) -> dict:
    """The fingerprint key of a loaded generator: hardware, model pair (names, dtype, quantization), placement."""
    info = generator.info
    models = {"target": info.target, "draft": info.draft, "dtype": info.dtype,
              "quant": load_cfg.offload.quant, "draft_quant": load_cfg.offload.draft_quant}
    if "draft_vocab" in info.extra:  # a reduced draft head: other draft steps and acceptance (full heads: no key)
        models["draft_vocab"] = info.extra["draft_vocab"]
    if "draft_mapping" in info.extra:  # a draft of another tokenizer, its proposals mapped (offspec/spec/xvocab.py)
        models["draft_mapping"] = "text"
    if generator.engine.target.device.type == "cpu":  # low-bit weights: which build of offspec's kernels, or torch's
        models["kernels"] = kernels.kernel_build()
    return profile_key(identity(generator.engine.target.device), models, info.extra.get("placement"))


PRIOR_FILES = {"default": "data/acceptance_prior.json",  # the default pair
               "self": "data/acceptance_prior_self.json"}  # the default target with its own Q3_K copy (`plan`)


def prior_acceptance(drafter: str = "model", pair: str = "default") -> tuple[AcceptanceCurve, str]:
    """The acceptance curve assumed before this pair is measured, with where it comes from."""
    curves, measured_with = prior_curves(pair)
    return curves[drafter], f"prior curve measured with {measured_with}"


def prior_curves(pair: str = "default") -> tuple[dict[str, AcceptanceCurve], str]:
    """Every drafter's prior acceptance curve, and the pair they were measured with (`pair`: PRIOR_FILES)."""
    name = PRIOR_FILES[pair]
    text = resources.files("offspec").joinpath(name).read_text(encoding="utf-8")
    data = validate(json.loads(text), f"offspec/{name}", AcceptanceFile)
    return acceptance_curves(data, "acceptance prior"), data["acceptance"].get("pair", "the default pair")


def suffix_seconds(generator, tokens: list[int], repeats: int = 3) -> float:
    """Seconds of one suffix proposal on `tokens` (its index built first, untimed); the median of `repeats`."""
    drafter = SuffixDrafter(device=generator.engine.target.device)  # a scratch one: the session's stays as it is
    config = TreeConfig(budget=min(64, generator.engine.max_budget), drafter="suffix")
    drafter.propose(tokens, config)
    return sorted(timed(lambda: drafter.propose(tokens, config), drafter.device) for _ in range(repeats))[repeats // 2]


def estimate_costs(generator, progress: ProgressFn = no_progress) -> tuple[PairCosts, str]:
    """A few timed passes on the loaded models (caches are left empty). Returns the costs and what they were."""
    engine = generator.engine
    draft = engine.drafter.runner  # None without a draft model
    timer = PassTimer(engine.target, draft, generator.tree.branch)
    draft_points, propose = [], []
    try:
        context = generator.encode(ESTIMATE_CONTEXT)[-max(1, engine.max_context // 2):]  # fits any context limit
        engine.reset_to(context)
        room = engine.target.capacity - engine.target.length
        # a mixture read as routed: the timed token's experts read once first (its first pass missed them all, 0.70 s
        # against 0.15 s for the next one on the Qwen3-30B-A3B twin, and planned trees for an ar 3x too slow)
        routed = RoutingRecorder(engine.target.model).layers_read_as_routed > 0
        target_cfg = replace(ESTIMATE_TARGET, largest=min(engine.max_budget + 1, room), warmup=routed)
        target_points, _ = sweep(timer.target_pass, engine.target.device, target_cfg, "estimate",
                                 "estimating the tree budget: target passes", progress)
        if draft is not None:
            engine.drafter.prefill(context)  # in the draft's own tokens (another tokenizer: mapped)
            draft_cfg = replace(ESTIMATE_DRAFT, largest=min(max(1, engine.max_budget), draft.capacity - draft.length))
            draft_points, _ = sweep(timer.draft_step, draft.device, draft_cfg, "estimate",
                                    "estimating the tree budget: draft steps", progress)
        head = timer.head(repeats=2)
        suffix = suffix_seconds(generator, context)
        if draft is not None:
            propose = estimate_propose(generator, context)
    finally:
        engine.forget()
    shown = ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in target_points)
    detail = f"target passes timed at start-up ({shown} by tokens)"
    if draft_points:
        detail += f", draft steps at {', '.join(str(n) for n, _ in draft_points)} nodes"
    if propose:
        detail += f", draft trees of {', '.join(f'{b}: {s * 1000:.0f} ms' for b, s in propose)} by budget"
    detail += f", a suffix proposal {suffix * 1000:.1f} ms"
    reads, said = estimate_expert_reads(generator, progress)
    return PairCosts(target_pass=CostCurve.of(target_points), target_head=head,
                     draft_step=CostCurve.of(draft_points) if draft_points else None,
                     draft_propose=CostCurve.of(propose) if propose else None, expand_ratio=1.0,
                     calibration_depth=CALIBRATION_DEPTH, suffix_seconds=suffix, expert_reads=reads), detail + said


def estimate_expert_reads(generator, progress: ProgressFn = no_progress) -> tuple[Optional[ExpertReads], str]:
    """On a mixture whose experts are read as routed and a draft model: the expert reads a pass pays, from the
    coverage of ESTIMATE_EXPERT_PASSES draft trees verified now (offspec/profile/coverage.py; a miss that never came
    priced at the bytes of an expert over the placement's assumed disk or link speed), and a few words for
    `budget_basis`; (None, "") elsewhere (the online re-pricing then has nothing to start from either)."""
    engine = generator.engine
    if not RoutingRecorder(engine.target.model).layers_read_as_routed or "model" not in engine.drafter.modes:
        return None, ""
    budgets = [b for b in ESTIMATE_EXPERT_BUDGETS if b <= engine.max_budget]
    run = measure_acceptance(generator, budgets, [{"prompt": ESTIMATE_CONTEXT}], ESTIMATE_EXPERT_PASSES, progress,
                             drafter="model", routing=True)
    section = run.experts
    if section is None:
        return None, ""
    if section["read_seconds"] is None:  # no pass missed: a miss at the placement's assumed speeds
        placement = generator.info.extra.get("placement") or {}
        seconds = unmissed_read_seconds(engine.target.model, placement, placement.get("assumed_bandwidth") or {})
        if seconds is None:
            return None, ""
        section = {**section, "read_seconds": seconds}
    reads = expert_reads_of(section, "start-up estimate")
    return reads, (f", the experts of {section['passes']} draft trees verified ({reads.coverage.describe()} per "
                   f"layer, {reads.miss_rate:.0%} missed the cache, {reads.read_seconds * 1e3:.2f} ms a miss)")


def estimate_propose(generator, context: list[int]) -> list[tuple[int, float]]:
    """Seconds to grow a whole model tree (automatic beams, the calibration depth) at ESTIMATE_PROPOSE's budgets,
    one timed call each after an untimed one, until ESTIMATE_PROPOSE_SECONDS are spent: [(budget, seconds)]."""
    engine = generator.engine
    drafter = engine.drafter
    points, start = [], time.perf_counter()
    for budget in ESTIMATE_PROPOSE:
        if budget > engine.max_budget or time.perf_counter() - start > ESTIMATE_PROPOSE_SECONDS:
            break
        config = TreeConfig(budget=budget, branch=generator.tree.branch, max_depth=CALIBRATION_DEPTH, drafter="model")
        propose = lambda: propose_after_a_pass(drafter, context, config)  # noqa: E731
        propose()  # untimed: sizes the tree buffers for this budget
        points.append((budget, timed(propose, drafter.runner.device)))
    return points


def _other_setup_acceptance(key: dict) -> tuple[dict[str, AcceptanceCurve], str]:
    """Where no profile matches this set-up: the acceptance curves of this same pair measured in the newest other
    one (another placement, machine or kernel build: `acceptance_profiles`), with what they are, for
    `budget_basis`; none where there is no such profile or it cannot be read (then the reason)."""
    others = acceptance_profiles(key)
    if not others:
        return {}, ""
    path = others[-1]
    try:
        return (acceptance_curves(load_profile(path), str(path)),
                f"acceptance measured in profile {path} (another placement, machine or kernel build: timings not used)")
    except OffspecError as exc:  # a damaged profile: said, and the prior used
        return {}, f" ({exc})"


def _over_prior(curves: dict[str, AcceptanceCurve], measured: dict[str, AcceptanceCurve], pair: str) -> str:
    """Put the `measured` curves over the prior's in `curves`; says which drafters keep the prior's."""
    prior = sorted(set(curves) - set(measured))
    curves.update(measured)
    return f"; acceptance of {', '.join(prior)}: prior curves measured with {pair}" if prior else ""


def apply_auto_budget(generator, load_cfg: LoadConfig, progress: Optional[ProgressFn] = None) -> AdaptiveBudget:
    """Plan the tree of a freshly loaded generator and attach the adaptive policy (see the module doc)."""
    progress = progress or no_progress
    progress(ProgressEvent("budget", "choosing the tree budget", 0, 1))
    key = pair_key(generator, load_cfg)
    path = find_profile(key)
    curves, pair = prior_curves()
    if path is not None:
        data = load_profile(path)
        costs, measured = costs_of(data, str(path)), acceptance_curves(data, str(path))
        if "suffix_propose_seconds" not in data["timings"]:  # a profile from before suffix drafting
            context = generator.encode(ESTIMATE_CONTEXT)[-max(1, generator.engine.max_context // 2):]
            costs = replace(costs, suffix_seconds=suffix_seconds(generator, context))
        quick = ", quick" if data.get("quick") else ""
        source, basis = "profile", f"measured profile {path} ({data.get('created', 'undated')}{quick})"
        basis += _over_prior(curves, measured, pair)
    else:
        costs, detail = estimate_costs(generator, progress)
        measured, acceptance = _other_setup_acceptance(key)
        if measured:
            acceptance += _over_prior(curves, measured, pair)
        else:  # the prior's curves; `acceptance` says why another profile's could not be used, if one was found
            acceptance = f"acceptance: prior curves measured with {pair}{acceptance}"
        source = "estimate"
        basis = f"start-up estimate: {detail}; {acceptance}; run `offspec profile` to measure this pair"
        stale = stale_profiles(key)
        if stale:  # measured with other CPU kernels or another draft head: say why it is not used
            path, what = stale[-1]
            note = (f"profile {path} was measured with {what}, so its timings are not used; run `offspec profile` "
                    f"to measure this set-up")
            basis += f"; {note}"
            progress(ProgressEvent("stale-profile", note, 1, 1, finished=True))
    costs = replace(costs, head_rows=generator.engine.head_rows)  # the engine's, also for a profile saved without it
    default = generator.tree.drafter
    policies = {}
    for mode in generator.engine.drafter.modes:  # a plan per drafter: `generate(..., drafter=...)` uses its own
        planner = PlannerConfig(branch=generator.tree.branch, max_budget=generator.engine.max_budget, drafter=mode)
        policies[mode] = AdaptiveBudget(costs, curves[mode], planner, extra=generator.info.extra,
                                        key="budget_adaptive" if mode == default else f"budget_adaptive_{mode}",
                                        gate_suffix=mode != "model")  # suffix candidates per pass, where they pay
        # the user's growth while loading (--grow-nodes) stays; the plan sets the budget and the tree's shape
        policies[mode].base_tree = replace(policies[mode].base_tree, grow_nodes=generator.tree.grow_nodes)
    policy = policies[default]
    if policy.plan.no_tree_reason:  # a mixture read as routed whose trees touch too many experts: say so
        basis += f"; no tree: {policy.plan.no_tree_reason}"
    generator.tree = policy.base_tree  # a caller that assigns another tree (e.g. bench) gets exactly that tree
    generator.policy, generator.policies = policy, policies
    generator.info = replace(generator.info, default_budget=policy.plan.best.budget)  # `extra` stays the same dict
    generator.info.extra.update(budget_source=source, budget_basis=basis, budget_plan=policy.plan.summary(),
                                budget_profile=str(path) if path else None)
    progress(ProgressEvent("budget", "choosing the tree budget", 1, 1, finished=True))
    return policy
