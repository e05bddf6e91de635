"""Rendering for the CLI: hardware facts, timing and acceptance tables, the plan curve, and its PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from offspec.util.files import atomic_write

from .coverage import CoverageCurve, ExpertReads
from .planner import Plan


def human(n: Optional[float], unit: str = "B") -> str:
    """Powers of 1000: 12.3 GB, 450 MB/s."""
    if n is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def hardware_lines(hw: dict) -> list[str]:
    lines = [f"device: {hw['device_type']} {hw['device_name']}"
             + (f", {human(hw.get('device_memory_bytes'))}" if hw.get("device_memory_bytes") else ""),
             f"host: {hw.get('cpu', '?')}, {hw['cpu_cores']} cores, {human(hw['host_ram_bytes'])} RAM"]
    rates = [("device memory", "device_memory_bandwidth", "B/s"), ("matmul", "device_flops", "FLOP/s"),
             ("disk read (offload dir)", "disk_read_bytes_per_s", "B/s"),
             ("host->device pinned", "h2d_pinned_bytes_per_s", "B/s"),
             ("host->device pageable", "h2d_pageable_bytes_per_s", "B/s")]
    shown = [f"{label} {human(hw[key], unit)}" for label, key, unit in rates if hw.get(key)]
    if shown:
        lines.append("speeds: " + ", ".join(shown))
    return lines


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def timings_table(timings: dict) -> str:
    target = dict((int(n), s) for n, s in timings["target_pass"])
    draft = dict((int(n), s) for n, s in timings["draft_step"])
    sizes = sorted(set(target) | set(draft))
    rows = [[str(n), f"{target[n] * 1e3:.1f}" if n in target else "", f"{draft[n] * 1e3:.1f}" if n in draft else ""]
            for n in sizes]
    rows_per_call = timings.get("head_rows") or 1
    per = "per walk position" if rows_per_call == 1 else f"per call (up to {rows_per_call} walk positions)"
    note = f"\nLM head + choice {per}: {timings['target_head_seconds'] * 1e3:.2f} ms"
    if timings.get("compute_bound_from"):
        note += f"; the target pass is compute-bound from about {timings['compute_bound_from']} tokens"
    return _table(["tokens/nodes", "target pass ms", "draft step ms"], rows) + note


def acceptance_table(acceptance: dict) -> str:
    depths = acceptance.get("depths") or [None] * len(acceptance["budgets"])
    rows = [[str(b), f"{a:.2f}", f"{d:.1f}" if d is not None else "-"]
            for b, a, d in zip(acceptance["budgets"], acceptance["accepted"], depths)]
    return _table(["budget", "accepted/pass", "tree depth"], rows)


def plan_table(plan: Plan) -> str:
    ar = plan.autoregressive_tokens_per_second
    rows = []
    for p in plan.curve:
        mark = " <" if p.budget == plan.best.budget else ""
        rows.append([str(p.budget), str(p.max_beams), str(p.max_depth), f"{p.tokens_per_pass:.2f}",
                     f"{p.draft_seconds * 1e3:.1f}", f"{p.target_seconds * 1e3:.1f}", f"{p.tokens_per_second:.2f}",
                     f"{p.tokens_per_second / ar:.2f}x{mark}" if ar else "-"])
    return _table(["budget", "beams", "depth", "tokens/pass", "draft ms", "target ms", "tokens/s", "speed-up"], rows)


def plan_summary(plan: Plan, label: str = "predicted") -> str:
    b = plan.best
    tree = f"--budget {b.budget} --max-beams {b.max_beams} --max-depth {b.max_depth} (branch {plan.branch})"
    text = (f"chosen: {tree}\n" if plan.speculates else
            f"chosen: the target alone (--budget auto decodes without a tree); the best tree: {tree}\n")
    text += (f"{label}: {b.tokens_per_second:.2f} tokens/s ({b.tokens_per_pass:.2f} tokens/pass, "
             f"{b.seconds * 1e3:.0f} ms/pass), autoregressive {plan.autoregressive_tokens_per_second:.2f} tokens/s, "
             f"speed-up {plan.speedup:.2f}x")
    if plan.coverage is not None:
        text += "\n" + coverage_line(plan.coverage, b.budget if plan.speculates else 0, plan.expert_reads)
    for note in plan.notes:
        text += f"\nnote: {note}"
    return text


def coverage_line(c: CoverageCurve, budget: int, reads: Optional[ExpertReads] = None) -> str:
    """The coverage curve, what the chosen budget (0: no tree) touches, and, where priced, what a miss costs."""
    chosen = f"the chosen budget {budget} touches {c(budget):.1f}" if budget else "no tree chosen"
    priced = (f"{reads.miss_rate:.0%} missed the cache at calibration, {reads.read_seconds * 1e3:.2f} ms a miss"
              if reads is not None else "resident or streamed whole: not priced")
    return (f"distinct experts per layer a pass routes to (of {c.experts_per_layer}): {c.describe()}; {chosen}; "
            f"{priced}")


def plot(plan: Plan, path: Path, title: str, projection: bool = False) -> Path:
    """tokens/s and tokens/pass vs budget (log scale), the chosen budget marked. Written atomically."""
    import matplotlib  # lazy: matplotlib takes a second to import, and only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [p.budget for p in plan.curve]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(budgets, [p.tokens_per_second for p in plan.curve], "o-", color="tab:blue",
            label="tokens/s" + (" (projected)" if projection else " (predicted)"))
    ax.axhline(plan.autoregressive_tokens_per_second, color="tab:gray", ls="--", label="autoregressive")
    ax.axvline(plan.best.budget, color="tab:red", ls=":", label=f"chosen budget {plan.best.budget}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (draft tokens per target pass)")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(budgets, [p.tokens_per_pass for p in plan.curve], "s--", color="tab:green", ms=3, label="tokens/pass")
    ax2.set_ylabel("tokens/pass", color="tab:green")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    ax.set_title(("PROJECTION: " if projection else "") + title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"), fsync=False)
    finally:
        plt.close(fig)
    return path
