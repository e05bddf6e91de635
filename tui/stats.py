"""Speed figures for the status line: tokens/s, tokens per target pass, tree budget, weight streaming, memory."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from offspec.types import GenerationResult, ModelInfo, PassStats

GIB = 1024 ** 3


def size_text(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB else f"{n_bytes / 1024 ** 2:.0f} MiB"


def io_wait_of(stats: PassStats) -> Optional[float]:
    """Seconds of the target pass spent waiting for streamed weights; None when the engine does not say."""
    value = getattr(stats, "io_wait_seconds", None)
    return float(value) if value is not None else None


@dataclass
class ReplyMeter:
    """Running figures of one reply, fed with each pass's statistics."""

    started: float = field(default_factory=time.monotonic)
    tokens: int = 0
    passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    io_wait_seconds: float = 0.0
    io_known: bool = False  # the target streams weights: a pass reported io wait or streamed bytes
    bytes_streamed: int = 0
    grown_nodes: int = 0  # tree nodes drafted while the passes' first streamed layers loaded
    experts_routed: int = 0  # a mixture's experts read as routed: (layer, expert) pairs run, and the cache's hits
    expert_hits: int = 0
    last_budget: Optional[int] = None
    seconds: Optional[float] = None  # the engine's wall time, once finished
    prefill_seconds: Optional[float] = None  # the prompt's part of it, once finished
    stop_reason: Optional[str] = None

    def add(self, token_count: int, passes: tuple[PassStats, ...] = ()) -> None:
        self.tokens += token_count
        for stats in passes:
            self.passes += 1
            self.target_seconds += stats.target_seconds
            self.draft_seconds += stats.draft_seconds
            self.last_budget = stats.budget
            wait = io_wait_of(stats)
            streamed = int(getattr(stats, "bytes_streamed", 0) or 0)
            if wait is not None and (wait > 0 or streamed > 0):  # nothing streamed: no weights/compute split
                self.io_known = True
            self.io_wait_seconds += wait or 0.0
            self.bytes_streamed += streamed
            self.grown_nodes += int(getattr(stats, "grown_nodes", 0) or 0)
            self.experts_routed += int(getattr(stats, "experts_routed", 0) or 0)
            self.expert_hits += int(getattr(stats, "expert_hits", 0) or 0)

    def finish(self, result: GenerationResult) -> None:
        """Replace the running counts with the engine's totals."""
        self.tokens = len(result.token_ids)
        self.passes = 0
        self.target_seconds = self.draft_seconds = self.io_wait_seconds = 0.0
        self.io_known, self.bytes_streamed, self.grown_nodes = False, 0, 0
        self.experts_routed = self.expert_hits = 0
        self.add(0, tuple(result.passes))
        self.seconds = result.seconds
        self.prefill_seconds = result.prefill_seconds if result.prefill_tokens else None  # all cached: no wait
        self.stop_reason = result.stop_reason

    def end(self, reason: str) -> None:
        """The reply ended without the engine's result (it failed): its clock stops here."""
        if self.seconds is None:
            self.seconds, self.stop_reason = self.elapsed, reason

    @property
    def elapsed(self) -> float:
        return self.seconds if self.seconds is not None else time.monotonic() - self.started

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    def summary(self) -> dict:
        """What is stored with a finished reply."""
        return {
            "tokens": self.tokens,
            "passes": self.passes,
            "seconds": round(self.elapsed, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "budget": self.last_budget,
            "io_wait_seconds": round(self.io_wait_seconds, 4) if self.io_known else None,
            "grown_nodes": self.grown_nodes,
            "experts_routed": self.experts_routed,
            "expert_hits": self.expert_hits,
            "prefill_seconds": round(self.prefill_seconds, 4) if self.prefill_seconds is not None else None,
        }


def budget_label(info: ModelInfo, fixed_budget: Optional[int], last_budget: Optional[int] = None) -> str:
    """'budget 64 (profile)': the tree budget in use and where it came from (profile, estimate, default or fixed);
    'target alone' or 'suffix drafts where they pay' where auto planned no tree (offspec.profile.adapt)."""
    if fixed_budget is not None:
        return f"budget {fixed_budget} (fixed)"
    source = str(info.extra.get("budget_source", "default"))
    if (info.extra.get("budget_adaptive") or {}).get("gated_suffix"):  # auto: no tree planned, suffix passes gated
        return f"suffix drafts where they pay ({source})"
    planned_none = (info.extra.get("budget_plan") or {}).get("speculate") is False
    if last_budget == 0 or (last_budget is None and planned_none):  # auto: the target alone is predicted faster
        return f"target alone ({source})"
    return f"budget {last_budget or info.default_budget} ({source})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def speed_line(meter: Optional[ReplyMeter], info: ModelInfo, fixed_budget: Optional[int]) -> str:
    """The first status line: speed of the current or last reply."""
    budget = budget_label(info, fixed_budget, meter.last_budget if meter else None)
    if meter is not None and meter.tokens == 0 and meter.passes == 0 and meter.seconds is None:
        # a reply under way before its first pass came back: the prompt's prefill (seconds on a CPU for a long one)
        return f"waiting for the first token · {meter.elapsed:.0f} s · {budget}"
    if meter is None or meter.tokens == 0 and meter.passes == 0:
        return f"ready · {budget}"
    parts = [f"{meter.tokens_per_second:.1f} tok/s", f"{meter.tokens_per_pass:.2f} tok/pass", budget]
    if meter.passes:
        per_pass = meter.target_seconds / meter.passes
        if meter.io_known:
            wait = meter.io_wait_seconds / meter.passes
            parts.append(f"target {_ms(per_pass)}/pass: {_ms(wait)} weights + {_ms(max(per_pass - wait, 0.0))} compute")
            if meter.io_wait_seconds > 0 and meter.bytes_streamed:
                parts.append(f"{meter.bytes_streamed / meter.io_wait_seconds / 1e9:.2f} GB/s")
            if meter.grown_nodes:  # drafted while the weights loaded (TreeConfig.grow_nodes)
                parts.append(f"+{meter.grown_nodes / meter.passes:.0f} nodes/pass while loading")
            if meter.experts_routed:  # a mixture's experts read as routed (offspec/offload/experts.py)
                read = (meter.experts_routed - meter.expert_hits) / meter.passes
                parts.append(f"{meter.experts_routed / meter.passes:.0f} experts/pass, {read:.0f} read "
                             f"({meter.expert_hits / meter.experts_routed:.0%} cached)")
        else:
            parts.append(f"target {_ms(per_pass)}/pass")
    parts.append(f"{meter.tokens} tok")
    if meter.prefill_seconds is not None:  # the wait before the first token went into the prompt's uncached part
        parts.append(f"prompt {meter.prefill_seconds:.2f} s")
    if meter.stop_reason:
        parts.append(meter.stop_reason)
    return " · ".join(parts)


class ResourceSampler:
    """Memory use of this process and, when the model is on CUDA, of the GPU."""

    def __init__(self, device: str):
        self.device = device

    def ram(self) -> str:
        try:
            import psutil
        except ImportError:
            return "RAM ?"
        rss = psutil.Process().memory_info().rss
        system = psutil.virtual_memory()
        return f"RAM {size_text(rss)} (system {system.percent:.0f}% of {size_text(system.total)})"

    def gpu(self) -> Optional[str]:
        torch = sys.modules.get("torch")  # never import torch just to look: the engine has it loaded if it uses it
        if not self.device.startswith("cuda") or torch is None:
            return None
        try:
            if not torch.cuda.is_available():
                return None
            index = torch.device(self.device).index
            index = torch.cuda.current_device() if index is None else index
            used = torch.cuda.memory_allocated(index)
            reserved = torch.cuda.memory_reserved(index)
            total = torch.cuda.get_device_properties(index).total_memory
        except Exception:  # a driver hiccup must not take the status line down
            return None
        return f"GPU {size_text(used)} used, {size_text(reserved)} reserved of {size_text(total)}"

    def line(self, info: ModelInfo) -> str:
        parts = [f"{info.device} {info.dtype}", self.gpu(), self.ram(), f"{info.target} ⇐ {info.draft}"]
        return " · ".join(p for p in parts if p)
