"""The option groups `offspec generate`, `chat`, `serve`, `profile` and `bench offload` share, and how their
flags become `offspec.load` options. Every sub-command's parser imports from here (not from cli.py, which
imports the sub-commands)."""

from __future__ import annotations

import argparse

from offspec.config import (AUTO_BUDGET, DRAFTERS, MAX_TOP_LOGPROBS, GenerationConfig, LoadConfig, OutputConfig,
                            SamplingConfig, TreeConfig, generation_configs, option_names)
from offspec.errors import OffspecError

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


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: local HF dir, .gguf file or hub id (default: built-in pair)")
    g.add_argument("--draft", help="draft model, same forms, any tokenizer (another one's proposals are mapped "
                   "through text); default: with --target, a cached model with its tokenizer, else the default "
                   "draft, else none; `none`: no draft model, the target speculates with suffix drafts alone; `self` "
                   "(or self:Q2_K): the target's own GGUF requantized to Q3_K, built once into the cache")
    g.add_argument("--draft-vocab", metavar="N|auto|full", help="tokens the draft's LM head scores: its N most "
                   "frequent (default auto: 65536 where a ranks table knows the tokenizer, else all), or full; the "
                   "target scores every token (lossless either way)")
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
    o.add_argument("--stream-head", choices=["auto", "always", "never"], help="on a CPU, read the target's LM head "
                   "from SSD in every pass (default auto: where the budget cannot keep it with every layer streamed)")
    o.add_argument("--experts", choices=["auto", "whole"], help="a mixture of experts that does not fit: auto (the "
                   "default) keeps the dense parts resident and fetches the routed experts into a cache, from RAM "
                   "where --ram-mem holds them all, else from SSD; whole streams its layers whole")
    o.add_argument("--expert-policy", choices=["lru", "lfu"], help="which cached expert makes room: lru (the "
                   "default: least recently used) or lfu (least often routed)")
    o.add_argument("--expert-prefetch", choices=["on", "off"], help="read the next layer's experts ahead, as its "
                   "router predicts them from this layer's input (default on)")
    t = p.add_argument_group("speculation tree")
    t.add_argument("--budget", type=_budget_arg, help="draft tokens per tree, or auto (the default: planned from "
                   "this machine's measured profile, see `offspec profile`, else a quick start-up estimate)")
    t.add_argument("--max-beams", type=int, help="nodes expanded per draft step (default: auto, budget/8 within [4, 64])")
    t.add_argument("--branch", type=int, help=f"children per expanded node (default {_TREE.branch})")
    t.add_argument("--max-depth", type=int, help=f"deepest tree level (default {_TREE.max_depth})")
    t.add_argument("--grow-nodes", type=int, metavar="N", help="a streamed target: while a pass's first streamed "
                   "layer is still being read, the draft grows its tree by up to N more nodes (default: the budget "
                   "again; 0 = never)")
    t.add_argument("--chain", type=int, metavar="DEPTH", help="classic speculative decoding: one draft chain")
    t.add_argument("--drafter", choices=list(DRAFTERS), help="who proposes the tree: the draft model, the suffix "
                   "index (continuations of text already seen), or both merged (default: hybrid, suffix with --draft none)")


GENERATION_FLAGS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "speculate")


def add_generation_args(p: argparse.ArgumentParser, defaults: dict) -> None:
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
                   help="plain autoregressive decoding of the target (the baseline); no draft model is loaded")


def generation_options(args: argparse.Namespace) -> dict:
    """The generation flags given on the command line (by option name), checked: an OffspecError before
    anything loads."""
    options = {n: getattr(args, n) for n in GENERATION_FLAGS if getattr(args, n, None) is not None}
    generation_configs(options)  # one `error:` line now, not after a minute of loading
    return options


def load_options(args: argparse.Namespace) -> dict:
    """The keyword options for `offspec.load` from parsed CLI flags (flags not given are left out)."""
    names = [n for n in option_names(LoadConfig, TreeConfig) if n not in ("target", "draft")]  # by field name
    options = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "chain", None) is not None:
        if options.get("drafter", "model") != "model":
            raise OffspecError("--chain is a chain of the draft model; drop --drafter or --chain")
        chain = TreeConfig.chain(args.chain)
        options.update(budget=chain.budget, max_beams=chain.max_beams, branch=chain.branch, max_depth=chain.max_depth,
                       drafter=chain.drafter)
    if getattr(args, "speculate", None) is False:  # --no-speculate: the loader then loads no draft model
        options["speculate"] = False
    return dict(target=args.target, draft=args.draft, **options)


def add_output_args(p: argparse.ArgumentParser, grammar: bool = True) -> None:
    """--json-schema (and, with `grammar`, --grammar and --logprobs): what the output follows, what comes with it."""
    g = p.add_argument_group("output")
    g.add_argument("--json-schema", metavar="FILE", help="the output is one JSON value following this JSON schema "
                   "(a .json file), enforced at every token with speculation on; `object`: any JSON object")
    if grammar:
        g.add_argument("--grammar", metavar="FILE", help="the output follows this Lark grammar (llguidance's "
                       "dialect: %%json {...} embeds a JSON schema)")
        g.add_argument("--logprobs", type=int, metavar="N", help=f"print each token's log-probability and the N "
                       f"likeliest alternatives' (0-{MAX_TOP_LOGPROBS}; needs --json)")


def output_options(args: argparse.Namespace) -> dict:
    """The output flags given (by option name), the files read and checked: an OffspecError before anything loads."""
    options: dict = {}
    if getattr(args, "json_schema", None) is not None:
        options["json_schema"] = True if args.json_schema == "object" else _read(args.json_schema, "JSON schema")
        if options["json_schema"] is not True:
            import json

            try:
                options["json_schema"] = json.loads(options["json_schema"])
            except json.JSONDecodeError as exc:
                raise OffspecError(f"--json-schema {args.json_schema} is not valid JSON ({exc.msg} at line "
                                   f"{exc.lineno}); pass a JSON schema file") from None
    if getattr(args, "grammar", None) is not None:
        options["grammar"] = _read(args.grammar, "grammar")
    if getattr(args, "logprobs", None) is not None:
        options["logprobs"] = args.logprobs
    OutputConfig(**options).validate()
    return options


def _read(path: str, what: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OffspecError(f"{what} file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OffspecError(f"cannot read the {what} file {path}: {exc}") from None
