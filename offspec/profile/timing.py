"""Timing sweeps: seconds of one target pass vs tokens, one draft step vs nodes, one LM-head position.

Each sweep grows the size geometrically and stops early once the work is clearly compute-bound (the last
two steps grew about as fast as the size), once one call takes longer than `max_call_seconds`, or once the
sweep has spent `max_total_seconds`. Past the last size, `CostCurve` extrapolates linearly.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.spec.runner import ModelRunner
from offspec.spec.sampling import draft_logprobs
from offspec.util.device import sync_compute


@dataclass(frozen=True)
class SweepConfig:
    largest: int = 4096  # biggest size tried
    factor: int = 2  # sizes grow by this factor: 1, 2, 4, ...
    repeats: int = 3  # timed calls per size (the median is kept), after one untimed warm-up call per sweep
    max_call_seconds: float = 20.0  # stop growing once one call takes longer than this
    max_total_seconds: float = 300.0  # stop growing once the sweep has spent this long
    compute_bound_ratio: float = 0.8  # "compute-bound": time grew by >= this share of the size growth ...
    compute_bound_steps: int = 2  # ... for this many consecutive steps
    min_bound_size: int = 16  # smaller sizes are too noisy to call compute-bound
    min_points: int = 2  # never stop before this many sizes (a slope needs two)
    sizes: tuple[int, ...] = ()  # explicit sizes instead of the geometric series (still capped by `largest`)
    warmup: bool = True  # one untimed call first
    probe: bool = True  # stopped early by time while still flat (e.g. streamed weights): probe bigger sizes, x8 apart


def timed(fn: Callable[[], object], device: torch.device) -> float:
    # sync: the compute stream only (queued compute is part of the time; the streamer's copy stream keeps
    # loading the next pass's layers, as it does between passes in real use)
    sync_compute(device)
    t0 = time.perf_counter()
    fn()
    sync_compute(device)
    return time.perf_counter() - t0


def sweep(run: Callable[[int], object], device: torch.device, config: SweepConfig, step: str, message: str,
          progress: ProgressFn = no_progress) -> tuple[list[tuple[int, float]], Optional[int]]:
    """Time `run(size)` over growing sizes. Returns ([(size, median seconds)], size it became compute-bound at)."""
    sizes = sorted({min(n, config.largest) for n in config.sizes}) if config.sizes else []
    n = 1
    while not config.sizes and n <= config.largest:
        sizes.append(n)
        n *= config.factor
    if not config.sizes and sizes[-1] != config.largest:
        sizes.append(config.largest)
    if config.warmup:
        run(1)  # first-call allocations and kernel selection are not part of a pass
    points: list[tuple[int, float]] = []
    bound_from, streak, start = None, 0, time.perf_counter()
    for i, size in enumerate(sizes):
        progress(ProgressEvent(step, f"{message}: {size}", i, len(sizes)))
        points.append((size, statistics.median(timed(lambda: run(size), device) for _ in range(config.repeats))))
        if len(points) >= 2:
            (n0, s0), (n1, s1) = points[-2], points[-1]
            grew = (s1 / s0 - 1) / (n1 / n0 - 1) if s0 > 0 else 1.0
            streak = streak + 1 if grew >= config.compute_bound_ratio and n1 >= config.min_bound_size else 0
            if streak >= config.compute_bound_steps and bound_from is None:
                bound_from = points[-1 - streak][0]
                break
        too_long = points[-1][1] > config.max_call_seconds or time.perf_counter() - start > config.max_total_seconds
        if too_long and len(points) >= config.min_points:
            still_flat = points[-1][1] < 2 * points[0][1]  # else compute already shows: no knee left to find
            if config.probe and bound_from is None and still_flat:
                points += _probe(run, device, config, points, start, step, message, progress)
            break
    progress(ProgressEvent(step, message, len(sizes), len(sizes), finished=True))
    return points, bound_from


def _probe(run, device, config: SweepConfig, points, start: float, step: str, message: str, progress: ProgressFn):
    """Single calls at sizes 8x apart, until the time has doubled (compute took over), the largest size is
    reached, or twice the sweep's time budget is spent: where streaming hides compute, this finds the knee."""
    found, size, first = [], points[-1][0], points[0][1]
    while size < config.largest and time.perf_counter() - start < 2 * config.max_total_seconds:
        size = min(config.largest, size * 8)
        progress(ProgressEvent(step, f"{message}: {size} (probe)", 0, None))
        found.append((size, timed(lambda: run(size), device)))
        if found[-1][1] > 2 * first:
            break
    return found


def propose_after_a_pass(drafter, tokens: list[int], config) -> None:
    """A tree grown as after a pass that accepted a token: the draft catches up on the last 2 tokens (the accepted
    one and the target's own) before growing (a two-token forward costs a CPU more than a one-token one)."""
    drafter.runner.cache.truncate(max(0, len(tokens) - 2))
    drafter.propose(tokens, config, 0.0)


class PassTimer:
    """Timed passes on the loaded runners, on top of a committed context the caller prefilled.

    Nothing is committed: each pass writes to scratch slots after the context, and the cache length stays.
    """

    def __init__(self, target: ModelRunner, draft: ModelRunner, branch: int):
        self.target, self.draft, self.branch = target, draft, branch

    @staticmethod
    def _pass(runner: ModelRunner, n: int) -> torch.Tensor:
        T, device = runner.length, runner.device
        tokens = torch.full((n,), 100, dtype=torch.long, device=device)  # (n,) any token ids will do
        positions = T + torch.arange(n, device=device) // 8  # (n,) tree-like: siblings share positions
        slots = torch.arange(T, T + n, device=device)  # (n,)
        visible = torch.ones((n, T + n), dtype=torch.bool, device=device)  # (n, T+n): a dense mask costs the same
        return runner.forward(tokens, positions, slots, visible)

    def target_pass(self, n: int) -> None:
        """One target forward over n tokens (the root and n-1 tree nodes)."""
        self._pass(self.target, n)

    def draft_step(self, k: int) -> None:
        """One draft step expanding k nodes: the forward, the LM head and the top-`branch` children."""
        hidden = self._pass(self.draft, k)  # (k, hidden)
        logp = draft_logprobs(self.draft.logits(hidden), 0.0)  # (k, V)
        torch.topk(logp, min(self.branch, logp.shape[-1]), dim=-1).indices.tolist()  # sync: the tree reads them

    def head(self, repeats: int = 5) -> float:
        """Seconds per acceptance-walk position: the target's LM head on one hidden state, then the argmax."""
        hidden = self._pass(self.target, 1)[0]  # (hidden,)
        run = lambda: int(torch.argmax(self.target.logits(hidden)))  # noqa: E731  sync: the walk needs the id
        run()
        return statistics.median(timed(run, self.target.device) for _ in range(repeats))
