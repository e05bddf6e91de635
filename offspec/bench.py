"""`offspec bench`: the same prompts through several decoding set-ups, side by side.

Set-ups: `ar` (the target alone, autoregressive), `chainN` (classic speculative decoding, one draft chain
of depth N) and plain integers (SpecExec trees of that budget). Greedy runs are checked token for token
against `ar` when it is among the set-ups. Results: a Markdown table and a JSON file with every
per-prompt number; partial results are written after each prompt, so a long run can be stopped.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from .config import TreeConfig
from .errors import OffspecError


@dataclass(frozen=True)
class Setup:
    name: str
    speculate: bool
    tree: Optional[TreeConfig] = None


def parse_setups(spec: str, base: TreeConfig) -> list[Setup]:
    setups = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "ar":
            setups.append(Setup("ar", speculate=False))
        elif item.startswith("chain") and item[5:].isdigit():
            setups.append(Setup(item, speculate=True, tree=TreeConfig.chain(int(item[5:]))))
        elif item.isdigit() and int(item) > 0:
            setups.append(Setup(f"tree{item}", speculate=True, tree=replace(base, budget=int(item))))
        else:
            raise OffspecError(f"unknown set-up {item!r} in --budgets; use ar, chainN or a positive budget")
    return setups


def run_bench(generator, prompts: list[str], setups: list[Setup], *, max_new_tokens: int, temperature: float,
              out_dir: Path, n_per_setup: Optional[int] = None,
              on_progress: Callable[[str, int, int], None] = lambda *a: None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(generator), "max_new_tokens": max_new_tokens, "temperature": temperature,
              "setups": {}}
    reference: dict[int, list[int]] = {}
    saved_tree = generator.tree
    try:
        for setup in setups:
            runs = []
            chosen = prompts[: n_per_setup or len(prompts)]
            for i, prompt in enumerate(chosen):
                on_progress(setup.name, i, len(chosen))
                if setup.tree is not None:
                    generator.tree = setup.tree
                result = generator.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                            seed=i, speculate=setup.speculate)
                run = {"prompt": i, "tokens": len(result.token_ids), "passes": result.n_passes,
                       "tokens_per_pass": result.tokens_per_pass, "seconds": result.seconds,
                       "tokens_per_second": result.tokens_per_second, "draft_seconds": result.draft_seconds,
                       "target_seconds": result.target_seconds, "token_ids": result.token_ids}
                if setup.name == "ar":
                    reference[i] = result.token_ids
                elif temperature == 0 and i in reference:
                    run["matches_ar"] = result.token_ids == reference[i]
                runs.append(run)
                report["setups"][setup.name] = summarize(runs)
                _write_json(out_dir / "bench.json", report)
            on_progress(setup.name, len(chosen), len(chosen))
    finally:
        generator.tree = saved_tree
    (out_dir / "bench.md").write_text(markdown_table(report), encoding="utf-8")
    return report


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    passes = sum(r["passes"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    summary = {
        "prompts": len(runs), "tokens": tokens, "passes": passes,
        "tokens_per_pass": tokens / passes if passes else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "draft_seconds_per_pass": sum(r["draft_seconds"] for r in runs) / passes if passes else 0.0,
        "target_seconds_per_pass": sum(r["target_seconds"] for r in runs) / passes if passes else 0.0,
        "runs": runs,
    }
    checked = [r["matches_ar"] for r in runs if "matches_ar" in r]
    if checked:
        summary["greedy_mismatches"] = checked.count(False)
    return summary


def markdown_table(report: dict) -> str:
    setups = report["setups"]
    ar = setups.get("ar")
    lines = ["| set-up | prompts | tokens/pass | tokens/s | speed-up vs ar | draft s/pass | target s/pass | "
             "greedy mismatches |", "|---|---|---|---|---|---|---|---|"]
    for name, s in setups.items():
        speedup = f"{s['tokens_per_second'] / ar['tokens_per_second']:.2f}x" if ar and ar["tokens_per_second"] else "-"
        mism = str(s.get("greedy_mismatches", "-"))
        lines.append(f"| {name} | {s['prompts']} | {s['tokens_per_pass']:.2f} | {s['tokens_per_second']:.2f} | "
                     f"{speedup} | {s['draft_seconds_per_pass']:.3f} | {s['target_seconds_per_pass']:.3f} | {mism} |")
    return "\n".join(lines) + "\n"


def environment(generator) -> dict:
    import psutil
    import torch
    import transformers

    info = generator.info
    return {"target": info.target, "draft": info.draft, "device": info.device, "dtype": info.dtype,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "torch": torch.__version__,
            "transformers": transformers.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)
