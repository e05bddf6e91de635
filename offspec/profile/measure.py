"""Measuring a loaded model pair: pass times, draft step times and the acceptance curve.

The acceptance curve comes from the real tree builder and verifier on the calibration prompts that ship
with offspec (`offspec/data/calibration.jsonl`: chat and code, several languages). One pass at the
largest budget B_max gives the acceptance at EVERY smaller budget: the tree SpecExec grows at budget B is
the top-B nodes (by cumulative draft log-prob) of the bigger tree, an ancestor-closed subset, so with
greedy verification the accepted path at budget B is the prefix of the big tree's path whose nodes rank
below B.

Each drafter has its own curve: the draft model's (`acceptance`), the suffix drafter's (`acceptance_suffix`:
its best-first tree at budget B is exactly the top-B nodes of the bigger one, so the same argument holds)
and the hybrid's (`acceptance_hybrid`: an approximation, since the model's early stop and the merge depend
on the budget). Every calibration prompt starts a fresh session (`engine.forget()`), so no drafter sees
an earlier output of the same prompt. Suffix passes also give the suffix proposal time, hybrid passes the
share of passes in which the draft model ran.

The first drafter's passes also record, on a mixture of experts, which experts each token of the verify pass was
routed to (offspec/profile/routing.py): the `experts` section, the coverage curve (offspec/profile/coverage.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.config import SamplingConfig, TreeConfig
from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.spec.sampling import TokenChooser
from offspec.util.prompts import read_prompts

from .curves import CostCurve
from .planner import BUDGETS
from .routing import RoutingRecorder, distinct_at, experts_section
from .store import ACCEPTANCE_SECTIONS
from .timing import PassTimer, SweepConfig, propose_after_a_pass, sweep, timed

CALIBRATION_DEPTH = 64  # max_depth of calibration trees (the planner may choose a smaller cap)


@dataclass(frozen=True)
class MeasureConfig:
    """How much to measure. `QUICK` takes about a minute on a small model; `FULL` is thorough."""

    target_sweep: SweepConfig = SweepConfig(largest=4096, repeats=3, max_call_seconds=20.0, max_total_seconds=300.0)
    draft_sweep: SweepConfig = SweepConfig(largest=256, repeats=3, max_call_seconds=5.0, max_total_seconds=120.0)
    prompts: int = 30  # calibration prompts used
    passes: int = 8  # speculative passes per prompt
    propose_contexts: int = 2  # contexts on which whole-tree draft times are taken, per budget
    max_cost_ratio: float = 16.0  # B_max: the largest budget whose target pass costs <= this many 1-token passes
    smallest_budget: int = 32  # ... but at least this (the curve needs a few points)
    largest_budget: int = 4096
    forced_budget: Optional[int] = None  # measure acceptance up to exactly this budget instead (--max-tree)


QUICK = MeasureConfig(target_sweep=SweepConfig(largest=4096, repeats=2, max_call_seconds=3.0, max_total_seconds=45.0),
                      draft_sweep=SweepConfig(largest=128, repeats=2, max_call_seconds=1.0, max_total_seconds=20.0),
                      prompts=4, passes=4, propose_contexts=1, max_cost_ratio=6.0, smallest_budget=16,
                      largest_budget=1024)
FULL = MeasureConfig()


def calibration_prompts(n: Optional[int] = None, path: Optional[Path] = None) -> list[dict]:
    """The shipped calibration prompts ({"prompt", "kind", "lang"}); `n` of them, alternating code and chat."""
    if path is None:
        text = resources.files("offspec").joinpath("data/calibration.jsonl").read_text(encoding="utf-8")
        where = "offspec/data/calibration.jsonl"
    else:
        return [{"prompt": p, "kind": "?", "lang": "?"} for p in read_prompts(path, n)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise OffspecError(f"{where}:{number}: not valid JSON ({exc.msg})") from None
    return records[: n or len(records)]  # the file alternates code and chat prompts


def _ranks(scores: torch.Tensor) -> list[int]:
    """(n,) cumulative log-probs -> rank of each node among the non-root nodes (root: -1).

    The same order as `DraftTree.trim`: higher score first, older node first on ties.
    """
    scores = scores.cpu()  # sync: the ranks are read on the host (a GPU tree's scores live on the GPU)
    order = torch.sort(scores[1:], descending=True, stable=True).indices + 1  # (n-1,)
    ranks = torch.empty_like(scores, dtype=torch.long)  # (n,)
    ranks[order] = torch.arange(order.numel())
    ranks[0] = -1
    return ranks.tolist()


class _Recorder:
    """Wraps the engine's drafter: keeps each proposed tree's scores and counts the nodes it expanded."""

    def __init__(self, inner):
        self.inner, self.runner = inner, inner.runner
        self.trees: list[tuple[list[int], list[int], int]] = []  # (ranks, depths, nodes expanded)
        self._expanded, self._in_extend = 0, False

    def __getattr__(self, name):  # kind, reset, forget, modes, ...: the wrapped drafter's
        return getattr(self.inner, name)

    def propose(self, tokens, config, temperature, grammar=None, grow=None):
        runner = self.runner
        self._expanded = 0
        if runner is None:  # no draft model: nothing to count
            tree = self.inner.propose(tokens, config, temperature, grammar=grammar, grow=grow)
            self.trees.append((_ranks(tree.scores[: tree.n]), tree.depths[: tree.n].tolist(), 0))
            return tree
        original_forward, original_extend = runner.forward, runner.extend

        def forward(tokens_, *args, **kwargs):
            if not self._in_extend:
                self._expanded += int(tokens_.numel())
            return original_forward(tokens_, *args, **kwargs)

        def extend(*args, **kwargs):
            self._in_extend = True
            try:
                return original_extend(*args, **kwargs)
            finally:
                self._in_extend = False

        saved = {name: runner.__dict__[name] for name in ("forward", "extend") if name in runner.__dict__}
        runner.forward, runner.extend = forward, extend
        try:
            tree = self.inner.propose(tokens, config, temperature, grammar=grammar, grow=grow)
        finally:
            for name in ("forward", "extend"):  # back to what they were (the class's methods, or a wrapper)
                if name in saved:
                    setattr(runner, name, saved[name])
                else:
                    delattr(runner, name)
        n = tree.n
        self.trees.append((_ranks(tree.scores[:n]), tree.depths[:n].tolist(), self._expanded))
        return tree

    def observe(self, accepted, n_committed):
        self.inner.observe(accepted, n_committed)


def _accepted_at(path: list[int], ranks: list[int], depths: list[int], budgets: list[int]
                 ) -> tuple[list[int], list[int]]:
    """Accepted count and deepest level of the top-B subtree, for each budget B."""
    accepted, deepest = [], []
    for b in budgets:
        count = 0
        for node in path[1:]:
            if ranks[node] >= b:
                break
            count += 1
        accepted.append(count)
        deepest.append(max((d for d, r in zip(depths, ranks) if 0 <= r < b), default=0))
    return accepted, deepest


@dataclass(frozen=True)
class AcceptanceRun:
    """What the calibration passes of one drafter measured."""

    section: dict  # the profile's acceptance section for this drafter
    expand_ratio: float  # draft nodes expanded per tree node (model drafter)
    draft_seconds: float  # mean seconds to propose a tree
    experts: Optional[dict] = None  # a mixture's `experts` section, where its routing was recorded


class _Routing:
    """The routing of each calibration pass's verify forward, as coverage rows (offspec/profile/routing.py)."""

    def __init__(self, engine, budgets: list[int]):
        self.engine, self.budgets = engine, [0, *budgets]
        self.recorder = RoutingRecorder(engine.target.model)
        self.rows: list[list[float]] = []
        self.routed = self.hits = 0
        self.wait = 0.0
        self.top_k = 0

    def install(self) -> None:
        """Record inside every `score_tree` of the engine until `remove()`."""
        original = self.engine.score_tree

        def score_tree(tree):
            with self.recorder.recording():
                return original(tree)

        self.engine.score_tree = score_tree  # an instance attribute over the class's method

    def remove(self) -> None:
        del self.engine.score_tree

    def observe(self, ranks: list[int], stats) -> None:
        ids = self.recorder.routing(stats.tree_size + 1)  # (layers, n, k)
        if ids is None:
            return
        self.top_k = int(ids.shape[-1])
        self.rows.append(distinct_at(ids, ranks, self.budgets, self.recorder.experts_per_layer))
        self.routed, self.hits = self.routed + stats.experts_routed, self.hits + stats.expert_hits
        self.wait += stats.io_wait_seconds

    def section(self) -> Optional[dict]:
        if not self.rows:
            return None
        r = self.recorder
        return experts_section(self.budgets, self.rows, self.top_k, r.experts_per_layer, len(r.blocks),
                               r.layers_read_as_routed > 0, self.routed, self.hits, self.wait)


def measure_acceptance(generator, budgets: list[int], prompts: list[dict], passes: int,
                       progress: ProgressFn = no_progress, drafter: str = "model",
                       routing: bool = False) -> AcceptanceRun:
    """Greedy speculative passes at max(budgets) with `drafter` on each prompt, each in a fresh session;
    `routing`: on a mixture of experts, record the experts each verify pass routes to (`AcceptanceRun.experts`)."""
    engine = generator.engine
    big = max(budgets)
    # confident_budget 0: every pass proposes at most `big` nodes, so the top-B argument holds (the larger trees of
    # confident suffix passes are left out of the curve: a conservative estimate for the planner)
    config = TreeConfig(budget=big, max_beams=0, branch=generator.tree.branch, max_depth=CALIBRATION_DEPTH,
                        drafter=drafter, confident_budget=0, grow_nodes=0)  # no growth: trees of `big` nodes at most
    recorder = _Recorder(engine.drafter)
    chooser = TokenChooser(SamplingConfig(), engine.target.device)
    samples, depth_rows, ratios, seconds, model_ran = [], [], [], [], []
    total = len(prompts) * passes
    routes = _Routing(engine, budgets) if routing and RoutingRecorder(engine.target.model).blocks else None
    engine.drafter = recorder
    if routes is not None:
        routes.install()
    try:
        for i, record in enumerate(prompts):
            ids = generator.encode(record["prompt"])
            if len(ids) + big + 2 >= engine.max_context:
                continue  # no room for even one calibration tree after this prompt
            engine.forget()  # a fresh session: no drafter has seen this prompt's output
            engine.reset_to(ids)
            for j in range(passes):
                progress(ProgressEvent("acceptance", f"{drafter} acceptance at budget {big}: "
                                       f"prompt {i + 1}/{len(prompts)}", i * passes + j, total))
                if engine.room <= big + 1:
                    break
                new, stats = engine.speculative_step(config, chooser, snapshot=True)
                ranks, depths, expanded = recorder.trees[-1]
                accepted, deepest = _accepted_at(list(stats.tree.accepted), ranks, depths, budgets)
                samples.append(accepted)
                depth_rows.append(deepest)
                ratios.append(expanded / max(1, stats.tree_size))
                seconds.append(stats.draft_seconds)
                if routes is not None:
                    routes.observe(ranks, stats)
                model_ran.append(stats.drafter in ("model", "hybrid"))
                if any(t in generator.eos_ids for t in new):
                    break
    finally:
        engine.drafter = recorder.inner
        if routes is not None:
            routes.remove()
        engine.forget()
    progress(ProgressEvent("acceptance", "acceptance", total, total, finished=True))
    if not samples:
        raise OffspecError("no calibration pass could run: the context is too short for the calibration trees; "
                           "raise --max-context")
    n = len(samples)
    section = {"budgets": budgets, "accepted": [round(sum(s[k] for s in samples) / n, 4) for k in range(len(budgets))],
               "depths": [round(sum(d[k] for d in depth_rows) / n, 3) for k in range(len(budgets))],
               "samples": samples, "temperature": 0.0, "prompts": len(prompts), "passes": n,
               "branch": config.branch, "max_depth": CALIBRATION_DEPTH,
               "pair": f"{generator.info.target} / {generator.info.draft}", "drafter": drafter}
    if drafter == "hybrid":
        section["model_share"] = round(sum(model_ran) / n, 4)
    return AcceptanceRun(section, statistics.mean(ratios), statistics.mean(seconds),
                         routes.section() if routes is not None else None)


def measure_propose(generator, budgets: list[int], prompts: list[dict], progress: ProgressFn = no_progress,
                    worth: Callable[[int, float], bool] = lambda budget, seconds: True) -> list[list[float]]:
    """Seconds to grow a whole tree at each budget (automatic beams, calibration depth): [[budget, seconds]].

    Budgets go up in order; on the first context, the first budget for which `worth(budget, seconds)` is false
    ends the list (growth only gets slower with the budget): only the budgets before it are timed further.
    """
    engine = generator.engine
    drafter = engine.drafter
    rows: dict[int, list[float]] = {}
    for i, record in enumerate(prompts):
        tokens = generator.encode(record["prompt"])[-max(1, engine.max_context // 2):]
        engine.reset_to(tokens)
        for k, b in enumerate(budgets if i == 0 else list(rows)):
            progress(ProgressEvent("propose", f"draft tree growth: budget {b}", i * len(budgets) + k,
                                   len(prompts) * len(budgets)))
            config = TreeConfig(budget=b, branch=generator.tree.branch, max_depth=CALIBRATION_DEPTH, drafter="model")
            propose = lambda: propose_after_a_pass(drafter, tokens, config)  # noqa: E731
            propose()  # untimed: sizes the tree buffers for this budget
            rows.setdefault(b, []).append(timed(propose, drafter.runner.device))
            if i == 0 and not worth(b, rows[b][-1]):
                del rows[b]
                break
    progress(ProgressEvent("propose", "draft tree growth", 1, 1, finished=True))
    return [[b, round(statistics.median(times), 6)] for b, times in rows.items()]


def measure_pair(generator, config: MeasureConfig = FULL, prompts: Optional[list[dict]] = None,
                 progress: ProgressFn = no_progress) -> dict:
    """The `timings` and `acceptance` sections of a profile for a loaded generator. Leaves the caches empty."""
    engine = generator.engine
    prompts = prompts if prompts is not None else calibration_prompts(config.prompts)
    draft = engine.drafter.runner  # None without a draft model: suffix drafting only
    timer = PassTimer(engine.target, draft, generator.tree.branch)
    draft_points, propose = [], []
    try:
        # a realistic context under the timed passes: the first calibration prompt, prefilled in both models
        context = generator.encode(prompts[0]["prompt"])[-max(1, engine.max_context // 2):]
        engine.reset_to(context)
        room = engine.target.capacity - engine.target.length
        target_cfg = _capped(config.target_sweep, min(room, engine.max_budget + 1))
        target_points, bound = sweep(timer.target_pass, engine.target.device, target_cfg, "target",
                                     "target pass time vs tokens", progress)
        if draft is not None:
            engine.drafter.prefill(context)  # in the draft's own tokens (another tokenizer: mapped)
            draft_cfg = _capped(config.draft_sweep, draft.capacity - draft.length)
            draft_points, _ = sweep(timer.draft_step, draft.device, draft_cfg, "draft", "draft step time vs nodes",
                                    progress)
        head = timer.head()


        curve = CostCurve.of(target_points)
        limit = config.max_cost_ratio * curve(1)
        if config.forced_budget:
            if config.forced_budget > engine.max_budget:
                raise OffspecError(f"--max-tree {config.forced_budget} is above max_budget {engine.max_budget}; "
                                   f"raise --max-budget")
            budgets = sorted({b for b in BUDGETS if b < config.forced_budget} | {config.forced_budget})
            if draft is not None:
                propose = measure_propose(generator, budgets, prompts[: config.propose_contexts], progress)
        else:
            cap = min(config.largest_budget, engine.max_budget)
            budgets = [b for b in BUDGETS if b <= cap and (curve(b + 1) <= limit or b <= config.smallest_budget)]
            # a calibration tree must fit after the shortest prompt, or no pass can run (short test contexts)
            fits = engine.max_context - min(len(generator.encode(p["prompt"])) for p in prompts) - 2
            budgets = [b for b in budgets if b < fits] or [b for b in BUDGETS if b < fits][:1] or budgets[:1]
            # growing the tree counts too: once growth + verification cost more than the limit, bigger trees
            # cannot pay off (their acceptance passes are the slowest part of a profile on a CPU)
            if draft is not None:
                propose = measure_propose(generator, budgets, prompts[: config.propose_contexts], progress,
                                          worth=lambda b, s: s + curve(b + 1) <= limit or b <= config.smallest_budget)
                budgets = [b for b, _ in propose]
        first = engine.drafter.modes[0]  # its passes also record a mixture's routing
        runs = {mode: measure_acceptance(generator, budgets, prompts, config.passes, progress, drafter=mode,
                                         routing=mode == first) for mode in engine.drafter.modes}
    finally:
        engine.forget()  # forget the calibration conversation
    timings = {"context_tokens": len(context), "target_pass": [[n, round(s, 7)] for n, s in target_points],
               "target_head_seconds": round(head, 7), "head_rows": engine.head_rows,
               "calibration_depth": CALIBRATION_DEPTH,
               "compute_bound_from": bound, "suffix_propose_seconds": round(runs["suffix"].draft_seconds, 7)}
    if draft is not None:
        timings.update(draft_step=[[n, round(s, 7)] for n, s in draft_points], draft_propose=propose,
                       expand_ratio=round(runs["model"].expand_ratio, 4))
    experts = {"experts": runs[first].experts} if runs[first].experts else {}
    return {"timings": timings, **{ACCEPTANCE_SECTIONS[mode]: run.section for mode, run in runs.items()}, **experts}


def _capped(sweep_cfg: SweepConfig, room: int) -> SweepConfig:
    from dataclasses import replace

    return replace(sweep_cfg, largest=max(1, min(sweep_cfg.largest, room)))
