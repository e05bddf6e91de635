"""`offspec bench`: the same prompts through several decoding set-ups, side by side, in one run.

Set-ups (comma list): `ar` (the target alone, autoregressive), `hf` (transformers' own assisted
generation with the same draft: a single chain), `chainN` (offspec with one draft chain of depth N),
integers (offspec trees of that budget, from the generator's drafter) and `auto` (the budget the generator
would pick itself). `model:`, `suffix:` or `hybrid:` before a budget or `auto` picks the drafter
(`hybrid:16` is named hybrid16, `suffix:auto` suffix-auto). Each prompt is a fresh session for every
set-up: the suffix drafter's index over earlier generations is off, or a set-up would copy the output
another set-up just wrote for the same prompt. With `session=True` (`--session`) the prompts are one session
per set-up instead, as in a chat or a server: before each prompt the index over earlier generations holds the
set-up's own replies to the prompts before it (never one to this prompt); the KV cache still starts cold.
Greedy runs are checked token for token against `ar` (run first when present); a mismatch is counted and
reported loudly. The `hf` peer is compared too but reported apart (`outputs_unlike_ar`): transformers attends
with SDPA, not offspec's exact kernel, so a near-tie may go the other way there. With the target on a CPU, a memory
copy is timed before each prompt (bench_machine.py): a pass bound by memory follows the machine's memory speed.
Tokens/s count each prompt's prefill (a user waits for it); "after the prompt" leaves it out, as llama.cpp's
`tg` does. Results: a Markdown table, PNG plots and a JSON with every per-prompt number and the environment; the JSON is
rewritten after each prompt, so a long run can be stopped and still read, and `resume=True` continues it (or
extends it to more prompts) with the same settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from offspec.config import DRAFTERS, TreeConfig
from offspec.errors import OffspecError
from offspec.formats.experts import expert_use
from offspec.util.files import atomic_write

from .bench_machine import disk_check, machine_notes, memory_check


@dataclass(frozen=True)
class Setup:
    name: str
    kind: str  # "ar", "hf", "tree"
    tree: Optional[TreeConfig] = None  # None with kind "tree" = the generator's own default ("auto")
    drafter: Optional[str] = None  # "auto" of another drafter than the generator's (its own plan)
    free: bool = False  # `free:`: not held to the bench's JSON schema (the unconstrained peer of the same run)


def bench_max_budget(setups: list[Setup], default_budget: int) -> Optional[int]:
    """The largest tree the bench's generator needs room for, or None (the load default) where a set-up is `auto`:
    auto plans as `offspec chat` does, up to the same max_budget, so it finds the profile `offspec profile` wrote
    for these flags (a profile is keyed by the placement, which max_budget changes) and may pick the trees chat
    would. Fixed budgets only: the largest of them (and the default tree's), so no activations are reserved for
    trees never built."""
    if any(s.kind == "tree" and s.tree is None for s in setups):
        return None
    return max([s.tree.budget for s in setups if s.tree is not None] + [default_budget])


def parse_setups(spec: str, base: TreeConfig) -> list[Setup]:
    """The set-ups of `--budgets`; `free:` before one: it does not follow `--json-schema` (named free-...)."""
    setups = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item.startswith("free:"):
            setup = parse_setups(item[5:], base)[0]
            setups.append(replace(setup, name=f"free-{setup.name}", free=True))
            continue
        drafter, _, rest = item.partition(":")
        if rest and drafter in DRAFTERS and (rest == "auto" or (rest.isdigit() and int(rest) > 0)):
            if rest == "auto":
                setups.append(Setup(f"{drafter}-auto", "tree", drafter=drafter))
            else:
                setups.append(Setup(f"{drafter}{rest}", "tree", replace(base, budget=int(rest), drafter=drafter)))
        elif item == "ar":
            setups.append(Setup("ar", "ar"))
        elif item == "hf":
            setups.append(Setup("hf-assisted", "hf"))
        elif item == "auto":
            setups.append(Setup("auto", "tree"))
        elif item.startswith("chain") and item[5:].isdigit() and int(item[5:]) > 0:
            setups.append(Setup(item, "tree", TreeConfig.chain(int(item[5:]))))
        elif item.isdigit() and int(item) > 0:
            setups.append(Setup(f"tree{item}", "tree", replace(base, budget=int(item))))
        else:
            raise OffspecError(f"unknown set-up {item!r} in --budgets; use ar, hf, auto, chainN, a positive budget, "
                               f"or model:, suffix:, hybrid: before a budget or auto")
    if not setups:
        raise OffspecError("--budgets names no set-up; e.g. --budgets ar,hf,16,64,auto")
    setups.sort(key=lambda s: s.kind != "ar")  # the references first, so every greedy run can be checked
    return setups


def run_one(generator, setup: Setup, prompt: str, *, max_new_tokens: int, temperature: float, seed: int,
            session: tuple[list[int], ...] = (), json_schema=None) -> dict:
    """One prompt through one set-up; the per-prompt record of the JSON. `session`: the set-up's replies to the
    prompts before this one, put into the session history (`run_bench(session=True)`). `json_schema`: the output
    follows it (the record says whether the text parses as JSON: a reply cut by max_new_tokens does not)."""
    if setup.kind == "hf":
        return _run_hf_assisted(generator, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    saved = generator.tree
    # Every run starts cold: no cached prompt prefix from the set-up before (it would skip this run's prefill)
    # and no suffix history but this set-up's own (another set-up may have just written this very prompt's answer).
    generator.engine.forget()
    generator.engine.drafter.remember(session)
    try:
        if setup.tree is not None:
            generator.tree = setup.tree
        result = generator.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    speculate=setup.kind == "tree", drafter=setup.drafter, json_schema=json_schema)
    finally:
        generator.tree = saved
    drafted = [p.drafter for p in result.passes if p.drafter]
    parsed = {}
    if json_schema is not None:
        try:
            json.loads(result.text)
            parsed = {"json_parses": True}
        except json.JSONDecodeError:
            parsed = {"json_parses": False}
    return {"tokens": len(result.token_ids), "passes": result.n_passes, "seconds": result.seconds, **parsed,
            "prefill_seconds": result.prefill_seconds, "prompt_tokens": result.prompt_tokens,
            "reused_prompt_tokens": result.reused_prompt_tokens,  # 0: every run pays its own prefill
            "drafters": {d: drafted.count(d) for d in sorted(set(drafted))},  # passes by what built the tree
            "draft_seconds": result.draft_seconds, "target_seconds": result.target_seconds,
            "io_wait_seconds": sum(p.io_wait_seconds for p in result.passes),
            "bytes_streamed": sum(p.bytes_streamed for p in result.passes),
            "grown_nodes": sum(p.grown_nodes for p in result.passes),  # drafted while the weights loaded
            # a mixture whose experts are read as routed: (layer, expert) pairs run, and those the cache held
            "experts_routed": sum(p.experts_routed for p in result.passes),
            "expert_hits": sum(p.expert_hits for p in result.passes),
            "budgets": sorted({p.budget for p in result.passes}), "token_ids": result.token_ids}


def _run_hf_assisted(generator, prompt: str, *, max_new_tokens: int, temperature: float, seed: int) -> dict:
    """transformers' assisted generation (`assistant_model=`): the same target and draft modules, plain
    `generate()`. Target passes are counted with a forward hook on the target."""
    import torch

    target = generator.engine.target.model
    if generator.engine.drafter.runner is None:
        raise OffspecError("set-up hf needs a draft model, and none is loaded (--draft none); drop hf from --budgets")
    if "draft_mapping" in generator.info.extra:  # transformers' assisted generation takes the target's token ids
        raise OffspecError("set-up hf needs a draft with the target's tokenizer; this draft's proposals are mapped "
                           "through text: drop hf from --budgets")
    draft = generator.engine.drafter.runner.model
    ids = torch.tensor([generator.encode(prompt)], device=generator.engine.target.device)
    calls = [0]
    hook = target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    kwargs = dict(max_new_tokens=max_new_tokens, assistant_model=draft, eos_token_id=sorted(generator.eos_ids),
                  pad_token_id=sorted(generator.eos_ids)[0], attention_mask=torch.ones_like(ids))
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target.generate(ids, **kwargs)
    finally:
        hook.remove()
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    if new and new[-1] in generator.eos_ids:
        new = new[:-1]  # offspec does not count the end-of-sequence token either
    return {"tokens": len(new), "passes": calls[0], "seconds": seconds, "draft_seconds": 0.0,
            "target_seconds": 0.0, "io_wait_seconds": 0.0, "bytes_streamed": 0, "grown_nodes": 0, "budgets": [],
            "token_ids": new}


def run_bench(generator, prompts: list[str], setups: list[Setup], *, max_new_tokens: int, temperature: float,
              out_dir: Path, on_progress: Callable[[str], None] = lambda name: None, resume: bool = False,
              on_resumed: Callable[[int], None] = lambda done: None, session: bool = False,
              json_schema=None) -> dict:
    """Every prompt through every set-up. With `resume`, the prompts already measured in `out_dir/bench.json`
    (by every set-up) are kept and only the rest run; the settings must match (see `_resumable`). `session`:
    the prompts are one session per set-up (see the module doc). `json_schema`: every set-up's output follows it
    (the report keeps the schema's hash)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    generator.engine.drafter.use_history(session)  # fresh sessions, or each set-up's own (see the module doc)
    schema_sha = (None if json_schema is None else
                  hashlib.sha256(json.dumps(json_schema, sort_keys=True).encode()).hexdigest()[:16])
    report = {"environment": environment(generator), "max_new_tokens": max_new_tokens,
              "temperature": temperature, "session": session, "json_schema": schema_sha, "prompts": len(prompts),
              "setups": {}}
    runs: dict[str, list[dict]] = {setup.name: [] for setup in setups}
    if resume and (out_dir / "bench.json").is_file():
        report, runs = _resumable(out_dir / "bench.json", report, runs, prompts)
    done = min(len(r) for r in runs.values())
    if done:
        on_resumed(done)
    disk_check(generator, report, done)
    # Prompt by prompt, every set-up in turn: a slow spell of a noisy machine then costs all set-ups alike
    # instead of whichever one happened to be running.
    for i in range(done, len(prompts)):
        prompt = prompts[i]
        memory_check(generator, report, i)
        references: dict[bool, list[int]] = {}  # the ar run's tokens, held to the schema (False) or free (True)
        for setup in setups:
            replies = tuple(r["token_ids"] for r in runs[setup.name]) if session else ()
            run = {"prompt": i, "prompt_sha": prompt_sha(prompt),
                   **run_one(generator, setup, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=i, session=replies, json_schema=None if setup.free else json_schema)}
            reference = references.get(setup.free or json_schema is None)
            if setup.kind == "ar":
                references[setup.free or json_schema is None] = run["token_ids"]
            elif temperature == 0 and reference is not None and setup.kind == "hf":
                # a peer: transformers computes the target's attention its own way (SDPA, not offspec's exact
                # kernel), so a near-tie can go the other way; reported, not counted as a losslessness failure
                run["same_as_ar"] = run["token_ids"] == reference
            elif temperature == 0 and reference is not None:
                run["matches_ar"] = run["token_ids"] == reference
            runs[setup.name].append(run)
            report["setups"][setup.name] = summarize(runs[setup.name])
            write_json(out_dir / "bench.json", report)
            on_progress(setup.name)
    disk_check(generator, report, len(prompts))
    use = expert_use(generator.engine.target.model)
    if use is not None:  # a mixture: how its routing spread over the experts (a twin's is not a real model's)
        report["expert_use"] = use
    if "budget_adaptive" in generator.info.extra:  # where auto's re-planning ended (the environment has its start)
        report["budget_adaptive_end"] = _snapshot(generator.info.extra["budget_adaptive"])
    write_json(out_dir / "bench.json", report)
    (out_dir / "bench.md").write_text(markdown_table(report), encoding="utf-8")
    plot(report, out_dir / "bench.png")
    return report


def prompt_sha(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def _thread_setting(env: dict):
    """The thread setting a report was measured with: "auto, at most N" when the governor sized torch's threads
    to the free cores (the count it had at any moment follows the machine's load), else the fixed count."""
    governed = (env.get("extra") or {}).get("threads")
    if isinstance(governed, dict) and governed.get("max_threads") is not None:
        return f"auto, at most {governed['max_threads']}"
    return env.get("torch_threads")


def _resumable(path: Path, fresh: dict, runs: dict[str, list[dict]], prompts: list[str]) -> tuple[dict, dict]:
    """The earlier report at `path` and its complete prompts (measured by every set-up), checked against the
    settings of this run. The earlier environment is kept; this run's is appended under "resumed"."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        old_setups = old["setups"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OffspecError(f"{path} is not a bench report; drop --resume or pick another --out") from None
    fix = "; rerun with the same settings, or drop --resume / pick another --out"
    if set(old_setups) != set(runs):
        raise OffspecError(f"{path} measured set-ups {','.join(old_setups)}, not {','.join(runs)}{fix}")
    for key in ("max_new_tokens", "temperature", "session", "json_schema"):
        if old.get(key, False if key == "session" else None) != fresh[key]:  # reports before --session: cold
            raise OffspecError(f"{path} used {key} {old.get(key)}, this run {fresh[key]}{fix}")
    old_env, env = old.get("environment", {}), fresh["environment"]
    placement = lambda e: (e.get("extra") or {}).get("placement", {}).get("tiers")  # noqa: E731
    for name, get in (("target", lambda e: e.get("target")), ("draft", lambda e: e.get("draft")),
                      ("device", lambda e: e.get("device")), ("dtype", lambda e: e.get("dtype")),
                      ("placement", placement), ("threads", _thread_setting)):
        if get(old_env) is not None and get(old_env) != get(env):
            raise OffspecError(f"{path} was measured with {name} {get(old_env)}, this run has {get(env)}{fix}")
    done = min(len(s.get("runs", [])) for s in old_setups.values())
    if done > len(prompts):  # rewriting the report with fewer prompts would drop measured ones
        raise OffspecError(f"{path} holds {done} measured prompts, more than the {len(prompts)} asked for; "
                           f"pass --n {done} or more")
    for name in runs:
        runs[name] = old_setups[name]["runs"][:done]  # a prompt that not every set-up finished runs again
        for i, run in enumerate(runs[name]):
            if run.get("prompt") != i or run.get("prompt_sha", prompt_sha(prompts[i])) != prompt_sha(prompts[i]):
                raise OffspecError(f"{path} prompt {i} is not prompt {i} of this prompt file{fix}")
    report = {**old, "prompts": len(prompts), "setups": {n: summarize(r) for n, r in runs.items()}}
    # records written before prompts were hashed are matched by their index only
    unchecked = sum("prompt_sha" not in run for run in next(iter(runs.values())))
    report["resumed"] = [*old.get("resumed", []), {"at_prompt": done, "prompts_matched_by_index_only": unchecked,
                                                    "environment": env}]
    return report, runs


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    passes = sum(r["passes"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    target_seconds = sum(r["target_seconds"] for r in runs)
    per_pass = (lambda key: sum(r[key] for r in runs) / passes) if passes else (lambda key: 0.0)
    summary = {
        "prompts": len(runs), "tokens": tokens, "passes": passes,
        "tokens_per_pass": tokens / passes if passes else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        # after each prompt's prefill, as llama.cpp's tg measures (None: a run that does not split it, e.g. hf)
        "decode_tokens_per_second": _decode_rate(runs),
        "draft_seconds_per_pass": per_pass("draft_seconds"),
        "target_seconds_per_pass": per_pass("target_seconds"),
        "io_wait_seconds_per_pass": per_pass("io_wait_seconds"),
        "bytes_streamed_per_pass": per_pass("bytes_streamed"),
        # tree nodes drafted while a pass's first layer loaded (runs resumed from before it was counted: none)
        "grown_nodes_per_pass": sum(r.get("grown_nodes", 0) for r in runs) / passes if passes else 0.0,
        # achieved weight-streaming bandwidth over the target passes (bytes/s; 0 when nothing streams)
        "stream_bandwidth": (sum(r["bytes_streamed"] for r in runs) / target_seconds) if target_seconds else 0.0,
        "budgets": sorted({b for r in runs for b in r["budgets"]}),
        **_expert_summary(runs, tokens),
        "drafters": {d: sum(r.get("drafters", {}).get(d, 0) for r in runs)
                     for d in sorted({d for r in runs for d in r.get("drafters", {})})},
        "runs": runs,
    }
    checked = [r["matches_ar"] for r in runs if "matches_ar" in r]
    if checked:
        summary["greedy_mismatches"] = checked.count(False)
    parses = [r["json_parses"] for r in runs if "json_parses" in r]
    if parses:
        summary["json_parses"] = sum(parses)  # outputs that are whole JSON (a reply cut short is not)
    peer = [r["same_as_ar"] for r in runs if "same_as_ar" in r]
    if peer:
        summary["outputs_unlike_ar"] = peer.count(False)  # a peer's own numerics (see run_bench)
    return summary


def _expert_summary(runs: list[dict], tokens: int) -> dict:
    """Experts read per token and the expert cache's hit rate, where a mixture's experts are read as routed."""
    routed = sum(r.get("experts_routed", 0) for r in runs)
    if not routed:
        return {}
    hits = sum(r.get("expert_hits", 0) for r in runs)
    return {"experts_routed_per_token": routed / tokens if tokens else 0.0,
            "experts_read_per_token": (routed - hits) / tokens if tokens else 0.0, "expert_hit_rate": hits / routed}


def _decode_rate(runs: list[dict]) -> Optional[float]:
    if not runs or any("prefill_seconds" not in r for r in runs):
        return None
    seconds = sum(r["seconds"] - r["prefill_seconds"] for r in runs)
    return sum(r["tokens"] for r in runs) / seconds if seconds > 0 else 0.0


def _mismatches(summary: dict) -> str:
    if "outputs_unlike_ar" in summary:  # a peer computing with its own numerics: not a losslessness check
        return f"{summary['outputs_unlike_ar']} (peer's own attention)"
    return str(summary.get("greedy_mismatches", "-"))


def markdown_table(report: dict) -> str:
    setups = report["setups"]
    ar = setups.get("ar")
    lines = ["| set-up | prompts | tokens/pass | tokens/s | tokens/s after the prompt | speed-up vs ar | draft s/pass | "
             "target s/pass | MB streamed/pass | nodes grown/pass | passes by drafter | greedy mismatches vs ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in setups.items():
        speedup = f"{s['tokens_per_second'] / ar['tokens_per_second']:.2f}x" if ar and ar["tokens_per_second"] else "-"
        budgets = ",".join(str(b) if b else "none" for b in s["budgets"])  # 0: passes without a tree
        label = name if name != "auto" and not name.endswith("-auto") else f"{name} (budget {budgets})"
        if name == "hf-assisted":  # transformers' generate: its passes are counted, not split or metered
            split = "- | - | - | -"
        else:
            split = (f"{s['draft_seconds_per_pass']:.3f} | {s['target_seconds_per_pass']:.3f} | "
                     f"{s['bytes_streamed_per_pass'] / 1e6:.0f} | {s.get('grown_nodes_per_pass', 0.0):.1f}")
        drafters = s.get("drafters") or {}
        shares = ", ".join(f"{d} {n / sum(drafters.values()):.0%}" for d, n in drafters.items()) or "-"
        decode = s.get("decode_tokens_per_second")  # None: not split (hf, or a report from before the split)
        lines.append(f"| {label} | {s['prompts']} | {s['tokens_per_pass']:.2f} | {s['tokens_per_second']:.2f} | "
                     f"{'-' if decode is None else f'{decode:.2f}'} | {speedup} | {split} | {shares} | {_mismatches(s)} |")
    for name, s in setups.items():
        if "expert_hit_rate" in s:
            lines.append(f"\n{name}: {s['experts_routed_per_token']:.1f} experts routed per token, "
                         f"{s['experts_read_per_token']:.1f} of them fetched (expert cache hit rate "
                         f"{s['expert_hit_rate']:.0%})")
    use = report.get("expert_use")
    if use:
        lines.append(f"\nexpert use (every set-up, prompts included): {use['used']} of {use['experts']} experts routed "
                     f"to; the most used {use['hot_50']} take 50% of the {use['routings']} routings "
                     f"({use['hot_50_bytes'] / 1e9:.2f} GB), {use['hot_90']} take 90% "
                     f"({use['hot_90_bytes'] / 1e9:.2f} GB), {use['hot_99']} take 99% "
                     f"({use['hot_99_bytes'] / 1e9:.2f} GB)")
    lines += machine_notes(report)
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Tokens/s and tokens per pass vs tree budget (trees), with the other set-ups as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = report["setups"]
    families: dict[str, list] = {}  # "tree" (the generator's drafter), "model", "suffix", "hybrid": (budget, summary)
    for n, s in setups.items():
        match = re.fullmatch(r"(tree|model|suffix|hybrid)(\d+)", n)
        if match:
            families.setdefault(match[1], []).append((int(match[2]), s))
    trees = [point for family in families.values() for point in family]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    # auto is a point at the budget most of its runs used (they may re-plan), the others horizontal lines
    auto = setups.get("auto")
    auto_budget = max(auto["budgets"], key=lambda b: sum(b in r["budgets"] for r in auto["runs"])) \
        if auto and auto["budgets"] else None  # 0 (no tree: the target alone predicted faster) is a line
    lines = [(n, s) for n, s in setups.items()
             if not re.fullmatch(r"(tree|model|suffix|hybrid)\d+", n) and not (n == "auto" and auto_budget)]
    for ax, key, label in ((axes[0], "tokens_per_second", "tokens/s"), (axes[1], "tokens_per_pass", "tokens per pass")):
        for family, points in families.items():
            points = sorted(points, key=lambda x: x[0])
            ax.plot([b for b, _ in points], [s[key] for _, s in points], "o-",
                    label="offspec tree" if family == "tree" else f"offspec {family}")
        if auto_budget:
            ax.plot([auto_budget], [auto[key]], "*", markersize=14, color="C3", label=f"auto (budget {auto_budget})")
        if trees or auto_budget:
            ax.set_xscale("log", base=2)
        for i, (name, s) in enumerate(lines):
            ax.axhline(s[key], linestyle="--", color=f"C{i + 4}", label=name)
        ax.set_xlabel("tree budget (draft tokens per pass)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    env = report["environment"]
    fig.suptitle(f"{env['target']} + {env['draft']} on {env['device']} ({env['cpu']}, {env['cores']} cores)",
                 fontsize=9)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), fsync=False)
    finally:
        plt.close(fig)


def environment(generator) -> dict:
    import psutil
    import torch
    import transformers

    info = generator.info
    env = {"target": info.target, "draft": info.draft, "device": info.device, "dtype": info.dtype,
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(),
           "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "extra": _snapshot(info.extra)}  # auto's state in it changes as it runs
    if info.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(info.device))  # the GPU it ran on, not GPU 0
    return env


def _snapshot(value):
    """A JSON-safe deep copy (the generator's `info.extra` is a live dict)."""
    return json.loads(json.dumps(value, default=str))


def write_json(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps(data, indent=1, default=str), fsync=False)
