"""The `offspec` command line (also `python main.py`). Sub-commands: setup, generate, chat, serve, bench, profile,
plan, doctor.

Errors a user can fix are one line on stderr (exit 2); Ctrl-C stops cleanly (exit 130).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .cli_progress import TqdmProgress
from .config import AUTO_BUDGET, DRAFTERS, GenerationConfig, LoadConfig, SamplingConfig, TreeConfig, generation_configs
from .errors import OffspecError, run_cli
from .progress import ProgressEvent

_TREE, _LOAD, _GEN, _SAMPLING = TreeConfig(), LoadConfig(), GenerationConfig(), SamplingConfig()


def _budget_arg(text: str):
    """--budget: "auto" or an integer (a budget <= 0 is refused later, as one `error:` line)."""
    if text.strip().lower() == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}") from None


def _threads_arg(text: str):
    """--threads: "auto" (None) or an integer (checked with the other options)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: local HF dir, .gguf file or hub id (default: built-in pair)")
    g.add_argument("--draft", help="draft model, same forms; must share the target's tokenizer; `none`: no draft "
                   "model, the target speculates with suffix drafts alone (any target)")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    g.add_argument("--max-context", type=int, help=f"context limit in tokens (default {_LOAD.max_context})")
    g.add_argument("--max-budget", type=int, help=f"largest tree budget allowed (default {_LOAD.max_budget})")
    g.add_argument("--threads", type=_threads_arg, metavar="N|auto", help="CPU threads (default auto: the cores "
                   "other processes leave free, re-checked while generating)")
    o = p.add_argument_group("offloading (the target's layers: resident on the device, streamed from RAM or SSD)")
    o.add_argument("--device-mem", metavar="SIZE", help="device memory budget, e.g. 20GB or 512MiB "
                   "(default: 92%% of what is free; more than is free is refused); on CPU it caps offspec's "
                   "process memory")
    o.add_argument("--ram-mem", metavar="SIZE", help="host RAM budget for layers streamed from RAM "
                   "(default: what is free on CUDA machines, 0 on CPU)")
    o.add_argument("--quant", choices=["none", "int4", "int8", "nf4"],
                   help="quantize a float (safetensors) target once: int4 (ggml Q4_1), int8 (ggml Q8_0), nf4 "
                        "(bitsandbytes, CUDA only); a GGUF keeps its own format")
    o.add_argument("--draft-quant", choices=["none", "int4", "int8", "nf4"], help="the same for a float draft")
    o.add_argument("--offload-dir", metavar="DIR", help="where packed per-layer files live (default: the cache dir)")
    t = p.add_argument_group("speculation tree")
    t.add_argument("--budget", type=_budget_arg, help="draft tokens per tree, or auto (the default: planned from "
                   "this machine's measured profile, see `offspec profile`, else a quick start-up estimate)")
    t.add_argument("--max-beams", type=int, help="nodes expanded per draft step (default: auto, budget/8 within [4, 64])")
    t.add_argument("--branch", type=int, help=f"children per expanded node (default {_TREE.branch})")
    t.add_argument("--max-depth", type=int, help=f"deepest tree level (default {_TREE.max_depth})")
    t.add_argument("--chain", type=int, metavar="DEPTH", help="classic speculative decoding: one draft chain")
    t.add_argument("--drafter", choices=list(DRAFTERS), help="who proposes the tree: the draft model, the suffix "
                   "index (continuations of text already seen), or both merged (default: hybrid, suffix with --draft none)")


GENERATION_FLAGS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "speculate")


def _add_generation_args(p: argparse.ArgumentParser, defaults: dict) -> None:
    """The generation options `generate` and `chat` share; `defaults` only feeds the help (a flag not given
    is left out, so each command keeps its own defaults: greedy for generate, the saved settings in chat)."""
    g = p.add_argument_group("generation")
    g.add_argument("--temperature", type=float, help=f"0 = greedy (default {defaults['temperature']:g})")
    g.add_argument("--top-p", type=float, help=f"nucleus sampling, in (0, 1] (default {defaults['top_p']:g})")
    g.add_argument("--top-k", type=int, help=f"sample among the k most likely tokens, 0 = off "
                                             f"(default {defaults['top_k']})")
    g.add_argument("--seed", type=int, help="random seed of sampling (default: a fresh one)")
    g.add_argument("--max-new-tokens", type=int, help=f"stop after this many tokens (default {defaults['max_new_tokens']})")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-speculate", dest="speculate", action="store_false", default=None,
                   help="plain autoregressive decoding of the target (the baseline)")


def generation_options(args: argparse.Namespace) -> dict:
    """The generation flags given on the command line (by option name), checked: an OffspecError before
    anything loads."""
    options = {n: getattr(args, n) for n in GENERATION_FLAGS if getattr(args, n, None) is not None}
    generation_configs(options)  # one `error:` line now, not after a minute of loading
    return options


def load_options(args: argparse.Namespace) -> dict:
    """The keyword options for `offspec.load` from parsed CLI flags (flags not given are left out)."""
    names = ["device", "dtype", "max_context", "max_budget", "budget", "max_beams", "branch", "max_depth",
             "drafter", "device_mem", "ram_mem", "quant", "draft_quant", "offload_dir", "threads"]
    options = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "chain", None) is not None:
        if options.get("drafter", "model") != "model":
            raise OffspecError("--chain is a chain of the draft model; drop --drafter or --chain")
        chain = TreeConfig.chain(args.chain)
        options.update(budget=chain.budget, max_beams=chain.max_beams, branch=chain.branch, max_depth=chain.max_depth,
                       drafter=chain.drafter)
    return dict(target=args.target, draft=args.draft, **options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("setup", help="install, assemble, verify and convert the default model pair "
                                 "(see `offspec setup --help`)", add_help=False)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    _add_generation_args(g, dict(vars(_SAMPLING), max_new_tokens=_GEN.max_new_tokens))
    g.add_argument("prompt", help="the prompt (sent as a user message through the chat template)")
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

    sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the models (see `offspec serve --help`)",
                   add_help=False)

    from tui.settings import ChatSettings

    c = sub.add_parser("chat", help="the terminal chat")
    _add_model_args(c)
    _add_generation_args(c, {**vars(_SAMPLING), **vars(ChatSettings())})
    c.add_argument("--data-dir", help="where chat history lives (default: XDG data dir)")
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    import offspec

    options = generation_options(args)  # checked before loading
    with TqdmProgress(enabled=sys.stderr.isatty() or not args.json) as progress:
        generator = offspec.load(progress=progress, **load_options(args))
    if args.json:
        result = generator.generate(args.prompt, **options)
        print(json.dumps(result.summary(), ensure_ascii=False))
        return 0
    result = None
    for event in generator.stream(args.prompt, **options):
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

    from .bench import markdown_table, parse_setups, run_bench
    from .prompts import read_prompts

    if args.n <= 0:
        raise OffspecError(f"--n must be a positive number of prompts, got {args.n}")
    generation_configs(dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    prompts = read_prompts(args.prompts, args.n)
    setups = parse_setups(args.budgets, TreeConfig())
    options = load_options(args)
    budgets = [s.tree.budget for s in setups if s.tree is not None] + [_TREE.budget]
    options.setdefault("max_budget", max(budgets))
    with TqdmProgress() as progress:
        generator = offspec.load(progress=progress, **options)
        state = {"done": 0, "total": len(prompts) * len(setups)}

        def resumed(done: int) -> None:
            state["total"] = (len(prompts) - done) * len(setups)

        def step(name: str) -> None:
            state["done"] += 1
            progress(ProgressEvent("bench", f"bench {name}", state["done"], state["total"]))

        report = run_bench(generator, prompts, setups, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, out_dir=Path(args.out), resume=args.resume,
                           on_resumed=resumed, on_progress=step)
        progress(ProgressEvent("bench", "bench", state["done"], state["total"], finished=True))
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
    from tui.settings import ChatSettings

    from .api import check_options

    # a bad option is one `error:` line before the chat opens, not a failed loading screen
    options = generation_options(args)
    ChatSettings().with_options(options)
    check_options(**load_options(args))
    return run_chat(load_options(args), data_dir=Path(args.data_dir) if args.data_dir else None,
                    generation=options)


def _delegated(argv: list[str]):
    """Sub-commands with their own parsers: `setup`, `profile`, `plan`, `serve`, `bench offload`
    and `doctor`."""
    if argv[:1] == ["setup"]:
        from .setup_cli import setup_main

        return lambda: setup_main(argv[1:])
    if argv[:1] == ["profile"]:
        from .profile.cli import profile_main

        return lambda: profile_main(argv[1:])
    if argv[:1] == ["plan"]:
        from .profile.cli import plan_main

        return lambda: plan_main(argv[1:])
    if argv[:1] == ["serve"]:
        from .serve.cli import serve_main

        return lambda: serve_main(argv[1:])
    if argv[:2] == ["bench", "offload"]:
        from .offload.bench import main as offload_bench_main

        return lambda: offload_bench_main(argv[2:])
    if argv[:1] == ["doctor"]:
        from .doctor.cli import main as doctor_main

        return lambda: doctor_main(argv[1:])
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": _cmd_generate, "bench": _cmd_bench, "chat": _cmd_chat}

    def command() -> int:
        delegated = _delegated(argv)
        if delegated is not None:
            return delegated()
        args = _parser().parse_args(argv)
        return commands[args.command](args)

    return run_cli(command)


if __name__ == "__main__":
    sys.exit(main())
