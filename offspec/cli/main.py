"""The `offspec` command line (also `python main.py`). Sub-commands: setup, generate, chat, serve, bench, profile,
plan, doctor, models.

Errors a user can fix are one line on stderr (exit 2); Ctrl-C stops cleanly (exit 130).

Each sub-command's modules are imported when it runs (imports inside the functions below, on purpose): `offspec
--help` and a mistyped option answer without loading torch, transformers or Textual.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from offspec.config import TreeConfig, generation_configs
from offspec.errors import OffspecError, run_cli
from offspec.progress import ProgressEvent

from .args import (_GEN, _SAMPLING, _TREE, add_generation_args, add_model_args, add_output_args, generation_options,
                   load_options, output_options)
from .progress import TqdmProgress


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offspec", description="Chat with a model that does not fit in memory: a small draft model (or text "
        "already seen) proposes a tree of tokens, and the target, streamed where it must be, verifies it in one pass.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("setup", help="install, assemble, verify and convert the default model pair "
                                 "(see `offspec setup --help`)", add_help=False)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(g)
    add_generation_args(g, dict(vars(_SAMPLING), max_new_tokens=_GEN.max_new_tokens))
    g.add_argument("prompt", help="the prompt (sent as a user message through the chat template, or as it is with "
                                  "--raw)")
    g.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template (as "
                   "/v1/completions does; to compare outputs with other tools, e.g. llama.cpp's)")
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_output_args(g)

    b = sub.add_parser("bench", help="tokens per pass and tokens/s of several set-ups on a prompt file "
                                     "(`offspec bench offload --help`: the offloading benchmark)")
    add_model_args(b)
    b.add_argument("--prompts", required=True, help="JSONL ({'turns': [...]} or {'prompt': ...}) or text file")
    b.add_argument("--n", type=int, default=20, help="prompts to use (default 20)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--budgets", default="ar,hf,16,64,256,1024",
                   help="comma list of set-ups: ar (target alone), hf (transformers assisted generation), chainN, "
                        "a tree budget, auto; model:, suffix:, hybrid: before a budget or auto; free: before any "
                        "set-up: not held to --json-schema (default ar,hf,16,64,256,1024)")
    b.add_argument("--out", default="bench-out", help="output directory (bench.json, bench.md)")
    b.add_argument("--resume", action="store_true",
                   help="continue the run in --out: keep the prompts it measured, run the rest (same settings)")
    b.add_argument("--session", action="store_true",
                   help="the prompts are one session per set-up, as in a chat or a server: the suffix drafter's "
                        "history holds the set-up's replies to the earlier prompts (default: every prompt cold)")
    add_output_args(b, grammar=False)

    sub.add_parser("profile", help="measure the machine and the model pair, choose the tree budget "
                                   "(see `offspec profile --help`)", add_help=False)
    sub.add_parser("plan", help="project tokens/s for hardware you do not have (see `offspec plan --help`)",
                   add_help=False)
    sub.add_parser("doctor", help="check what offspec will do on this machine: device, copies, SSD, streaming "
                                  "(see `offspec doctor --help`)", add_help=False)

    sub.add_parser("models", help="list the models in the cache, with their size and tokenizer; `offspec models rm "
                                  "NAME` frees the space (see `offspec models --help`)", add_help=False)

    sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the models (see `offspec serve --help`)",
                   add_help=False)

    from tui.settings import ChatSettings

    c = sub.add_parser("chat", help="the terminal chat")
    add_model_args(c)
    add_generation_args(c, {**vars(_SAMPLING), **vars(ChatSettings())})
    c.add_argument("--data-dir", help="where chat history lives (default: XDG data dir)")
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    import offspec
    from offspec.util.reasoning import held_from_start, split_reasoning

    options = {**generation_options(args), **output_options(args)}  # checked before loading
    if "logprobs" in options and not args.json:
        raise OffspecError("--logprobs prints with --json; add --json")
    with TqdmProgress(enabled=sys.stderr.isatty() or not args.json) as progress:
        generator = offspec.load(progress=progress, **load_options(args))
    if args.raw:
        options["raw"] = True
    # a reasoning model's reasoning apart from its answer; a raw prompt is a plain completion, left as it is
    reasoning = None if args.raw else getattr(generator, "reasoning", None)
    if "json_schema" in options or "grammar" in options:
        reasoning = held_from_start(reasoning)
    if args.json:
        result = generator.generate(args.prompt, **options)
        split = split_reasoning(result.text, reasoning)
        summary = {"text": split.answer, "reasoning": split.reasoning if reasoning is not None else None,
                   **{k: v for k, v in result.summary().items() if k != "text"}}  # null: the model does not reason
        print(json.dumps(summary, ensure_ascii=False))
        return 0
    result = None
    out = ReasoningOutput(reasoning)
    for event in generator.stream(args.prompt, **options):
        if hasattr(event, "stop_reason"):
            result = event
        elif event.text:
            out.write(event.text)
    out.close()
    print(f"[{len(result.token_ids)} tokens, {result.n_passes} passes, {result.tokens_per_pass:.2f} tokens/pass, "
          f"{result.tokens_per_second:.2f} tokens/s; {_prompt_part(result)}, stop: {result.stop_reason}]",
          file=sys.stderr)
    return 0


class ReasoningOutput:
    """`offspec generate`'s text: the answer on stdout, the reasoning (dimmed on a terminal) on stderr, so that what a
    pipe or a file gets is the answer alone."""

    def __init__(self, reasoning):
        from offspec.util.reasoning import ReasoningSplitter

        self.splitter = ReasoningSplitter(reasoning)
        self.reasoned = False  # some reasoning went to stderr (its line is ended before the answer's first text)
        self.dim = sys.stderr.isatty()

    def write(self, text: str) -> None:
        self._show(self.splitter.feed(text))

    def close(self) -> None:
        self._show(self.splitter.finish())
        if self.reasoned:
            sys.stderr.write("\n")
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _show(self, split) -> None:
        if split.reasoning:
            sys.stderr.write(f"\x1b[2m{split.reasoning}\x1b[0m" if self.dim else split.reasoning)
            sys.stderr.flush()
            self.reasoned = True
        if split.answer:
            if self.reasoned:
                sys.stderr.write("\n")
                self.reasoned = False
            sys.stdout.write(split.answer)
            sys.stdout.flush()


def _prompt_part(result) -> str:
    """The prompt's share of a generation, as llama.cpp splits its prompt and eval times."""
    cached = f" ({result.reused_prompt_tokens} cached)" if result.reused_prompt_tokens else ""
    return (f"prompt {result.prompt_tokens} tokens{cached} in {result.prefill_seconds:.2f} s, "
            f"then {result.decode_tokens_per_second:.2f} tokens/s")


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import offspec
    from offspec.util.prompts import read_prompts

    from .bench import bench_max_budget, markdown_table, parse_setups, run_bench

    if args.n <= 0:
        raise OffspecError(f"--n must be a positive number of prompts, got {args.n}")
    generation_configs(dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    schema = output_options(args).get("json_schema")
    prompts = read_prompts(args.prompts, args.n)
    setups = parse_setups(args.budgets, TreeConfig())
    if schema is not None and any(s.kind == "hf" and not s.free for s in setups):
        raise OffspecError("set-up hf (transformers' assisted generation) cannot follow a JSON schema; drop hf from "
                           "--budgets or --json-schema")
    options = load_options(args)
    if (largest := bench_max_budget(setups, _TREE.budget)) is not None:
        options.setdefault("max_budget", largest)
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
                           on_resumed=resumed, on_progress=step, session=args.session, json_schema=schema)
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

    from offspec.api import check_options
    from tui.app import run_chat
    from tui.settings import ChatSettings

    # a bad option is one `error:` line before the chat opens, not a failed loading screen
    options = generation_options(args)
    ChatSettings().with_options(options)
    check_options(**load_options(args))
    return run_chat(load_options(args), data_dir=Path(args.data_dir) if args.data_dir else None,
                    generation=options)


def _delegated(argv: list[str]):
    """Sub-commands with their own parsers: `setup`, `profile`, `plan`, `serve`, `bench offload`,
    `doctor` and `models`."""
    if argv[:1] == ["setup"]:
        from .setup import setup_main

        return lambda: setup_main(argv[1:])
    if argv[:1] == ["profile"]:
        from .profile import profile_main

        return lambda: profile_main(argv[1:])
    if argv[:1] == ["plan"]:
        from .profile import plan_main

        return lambda: plan_main(argv[1:])
    if argv[:1] == ["serve"]:
        from .serve import serve_main

        return lambda: serve_main(argv[1:])
    if argv[:2] == ["bench", "offload"]:
        from .bench_offload import main as offload_bench_main

        return lambda: offload_bench_main(argv[2:])
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor_main

        return lambda: doctor_main(argv[1:])
    if argv[:1] == ["models"]:
        from .models import main as models_main

        return lambda: models_main(argv[1:])
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
