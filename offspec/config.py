"""Configuration: frozen dataclasses, one place for every default. The CLI builds them by field name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

from .errors import OffspecError

QUANTS = ("none", "int4", "int8", "nf4")  # --quant for float checkpoints (offspec/formats/quantize.py)

AUTO_BUDGET = "auto"  # budget="auto", the default: planned for this machine and model pair (offspec.profile)
NO_DRAFT = "none"  # draft="none": no draft model; the target speculates with suffix drafts alone
DRAFTERS = ("model", "suffix", "hybrid")  # who proposes the tree: the draft model, the suffix index, or both merged


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def head_calls(positions: float, rows: int = 1) -> float:
    """LM-head reads for `positions` walk positions where one call covers `rows` of them (the engine batches the
    walk's likely rows where the head is row-invariant, `Engine.head_rows`): one read up to `rows` positions, then
    in proportion (a smooth ceil); one per position where rows is 1."""
    return positions if rows <= 1 else max(1.0, positions / rows)


@dataclass(frozen=True)
class PassCost:
    """Seconds of one target pass: base + per_node * nodes, plus the LM head's calls for the acceptance walk.
    With `measured`, the nodes' share follows those points instead: (nodes, seconds above base), piecewise linear
    between them and past the last at its slope (a CPU's tile kernels cost nearly as much for 4 tokens as for 16,
    which no straight line through 1 and 16 says)."""

    base: float  # the pass over the root alone (the target alone's pass, without the head)
    per_node: float  # each tree node verified beside it
    head: float = 0.0  # LM head and token choice, per head call (see head_calls: per position where rows is 1)
    measured: tuple[tuple[int, float], ...] = ()  # (nodes, seconds above base), nodes increasing, from 0
    head_rows: int = 1  # walk positions one head call covers

    def validate(self) -> "PassCost":
        if not all(math.isfinite(x) and x >= 0 for x in (self.base, self.per_node, self.head)) or self.base <= 0:
            raise ValueError(f"pass cost needs base > 0 and per_node, head >= 0, got {self}")
        nodes = [n for n, _ in self.measured]
        if self.measured and (nodes[0] != 0 or nodes != sorted(set(nodes)) or
                              not all(math.isfinite(s) and s >= 0 for _, s in self.measured)):
            raise ValueError(f"pass cost points need increasing nodes from 0 and finite seconds >= 0, got {self}")
        return self

    def nodes_seconds(self, nodes: int) -> float:
        """Seconds the nodes add to the pass."""
        pts = self.measured
        if len(pts) < 2:
            return self.per_node * nodes
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if nodes <= n1:
                return s0 + (s1 - s0) * (nodes - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (nodes - n1)

    def seconds(self, nodes: int, expected_tokens: float) -> float:
        return self.base + self.nodes_seconds(nodes) + self.head * head_calls(expected_tokens, self.head_rows)


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the speculation tree (SpecExec)."""

    budget: int = 64  # draft tokens in the tree; the target verifies budget + 1 tokens (the root too)
    max_beams: int = 0  # nodes expanded per draft step, in one batched draft forward; 0 = auto (see `beams`)
    branch: int = 8  # children added per expanded node (the draft's top-k)
    max_depth: int = 32  # nodes deeper than this are never expanded
    # who proposes the tree: "model" (the draft model), "suffix" (continuations of text already seen), "hybrid"
    # (both merged under one budget); None = hybrid when a draft model is loaded, else suffix (set at load)
    drafter: Optional[str] = None
    # a pass from a long, confident suffix match alone (no draft model step; see offspec/spec/suffix_drafter.py) may
    # propose up to this many nodes instead of `budget`, as deep as that past `max_depth` (SuffixDecoding's
    # adaptive speculation); 0 = `budget`
    confident_budget: int = 32
    # the target pass's cost model: suffix-only trees keep just the candidates that pay for their place in the
    # pass (offspec/spec/gain.py), possibly none; None = every candidate up to the budget. `budget="auto"` sets it
    pass_cost: Optional[PassCost] = None
    # what the plan expects of the draft model's tree in a hybrid pass: (accepted tokens, draft seconds). With
    # `pass_cost`, a hybrid pass grows that tree only where it is expected to beat the suffix candidates that pay on
    # their own (a copy of given text takes those, prose the model's tree); None = always. `budget="auto"` sets it
    model_expectation: Optional[tuple[float, float]] = None
    # a streamed target: while the pass's first streamed layer is still being read (ShadowSpec), the draft model
    # keeps growing the tree that pass will verify, up to this many nodes past `budget`; None = `budget` more
    # (at most twice the tree), 0 = never (offspec/spec/drafter.py, PassStats.grown_nodes)
    grow_nodes: Optional[int] = None

    @property
    def growth(self) -> int:
        """The most nodes the tree may gain past `budget` while the weights load (`grow_nodes`)."""
        return self.budget if self.grow_nodes is None else self.grow_nodes

    @property
    def beams(self) -> int:
        """Nodes expanded per draft step: `max_beams`, or when 0, budget/8 within [4, 64] (bigger trees
        take wider steps, so the number of sequential draft forwards grows slowly with the budget)."""
        return self.max_beams if self.max_beams > 0 else min(64, max(4, self.budget // 8))

    def validate(self) -> "TreeConfig":
        for name in ("budget", "max_beams", "branch", "max_depth", "confident_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
                    value == 0 and name not in ("max_beams", "confident_budget")):
                auto = " or auto" if name == "budget" else ""
                raise OffspecError(f"{name} must be a positive integer{auto}, got {value!r}; "
                                   f"pass e.g. --{name.replace('_', '-')} 64")
        if self.grow_nodes is not None and (not isinstance(self.grow_nodes, int) or isinstance(self.grow_nodes, bool)
                                            or self.grow_nodes < 0):
            raise OffspecError(f"grow_nodes must be a whole number >= 0 (0: the tree never grows while the weights "
                               f"load), got {self.grow_nodes!r}; pass e.g. --grow-nodes 64")
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise OffspecError(f"unknown drafter {self.drafter!r}; use {', '.join(DRAFTERS)}")
        if self.pass_cost is not None:
            try:
                self.pass_cost.validate()
            except (AttributeError, TypeError, ValueError) as exc:
                raise OffspecError(f"pass_cost must be an offspec.spec.gain.PassCost with base > 0: {exc}") from None
        expectation = self.model_expectation
        if expectation is not None and not (isinstance(expectation, tuple) and len(expectation) == 2 and all(
                isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in expectation)):
            raise OffspecError(f"model_expectation must be (accepted tokens, draft seconds), both >= 0, "
                               f"got {self.model_expectation!r}")
        return self

    @classmethod
    def chain(cls, depth: int = 5) -> "TreeConfig":
        """Classic speculative decoding: a single greedy draft chain of `depth` tokens."""
        return cls(budget=depth, max_beams=1, branch=1, max_depth=depth, drafter="model", confident_budget=0)


@dataclass(frozen=True)
class SuffixConfig:
    """Model-free drafting from text already seen (SuffixDecoding-style): see `offspec.spec.suffix_drafter`."""

    key_length: int = 4  # the index maps every k-gram, k = 1..key_length, to where it occurred
    max_match: int = 32  # a matching suffix is compared back at most this far
    min_match: int = 1  # shorter matches propose nothing
    max_occurrences: int = 256  # the most recent occurrences of a match that are counted
    spec_factor: float = 4.0  # candidates reach at most spec_factor * match length deep (adaptive speculation)
    match_half: float = 2.0  # the prior of q(m), the chance a match of m tokens goes on one more: m / (m + match_half)
    confident_match: int = 8  # a match this long whose best continuation ...
    confident_share: float = 0.5  # ... follows at least this share of its occurrences is confident: the hybrid
    # skips the draft model, and the pass may propose up to TreeConfig.confident_budget nodes
    global_tokens: int = 65536  # bound of the session index over earlier generations (0 = none)

    def validate(self) -> "SuffixConfig":
        if self.key_length < 1 or self.max_match < self.key_length or self.min_match < 1:
            raise OffspecError("suffix index: need key_length >= 1, max_match >= key_length and min_match >= 1")
        if self.max_occurrences < 1 or self.spec_factor <= 0 or self.match_half < 0:
            raise OffspecError("suffix index: max_occurrences, spec_factor must be positive; match_half must be "
                               ">= 0")
        if self.global_tokens < 0:
            raise OffspecError(f"suffix index: global_tokens must be >= 0, got {self.global_tokens}")
        return self


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's token is chosen at each position. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingConfig":
        if not _is_number(self.temperature) or not (0.0 <= self.temperature < math.inf):
            raise OffspecError(f"temperature must be a number >= 0, got {self.temperature!r}; use 0 for greedy "
                               f"(--temperature 0) or e.g. 0.7")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise OffspecError(f"top_p must be in (0, 1], got {self.top_p!r}; use 1 to turn it off (--top-p 1)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise OffspecError(f"top_k must be a whole number >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise OffspecError(f"seed must be a whole number >= 0, got {self.seed!r}")
        return self


@dataclass(frozen=True)
class GenerationConfig:
    """When to stop, and whether to speculate."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    speculate: bool = True  # False = plain autoregressive decoding of the target (the baseline)

    def validate(self) -> "GenerationConfig":
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise OffspecError(f"max_new_tokens must be a positive whole number, got {self.max_new_tokens!r}; "
                               f"pass e.g. --max-new-tokens 256")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise OffspecError(f"stop must be a list of strings, got {self.stop!r}")
        return self


MAX_TOP_LOGPROBS = 20  # the most alternatives' log-probabilities returned per token (OpenAI's limit)


@dataclass(frozen=True)
class OutputConfig:
    """What the output must follow (a JSON schema or a grammar, enforced at every token, speculation on), and what
    is returned beside it."""

    json_schema: Any = None  # a JSON schema (a dict or its JSON text; True: any JSON object) the output follows
    grammar: Optional[str] = None  # or a Lark grammar (llguidance's dialect: offspec/spec/grammar.py)
    logprobs: Optional[int] = None  # each token's log-probability and this many alternatives' (0-20); None: off

    @property
    def constrained(self) -> bool:
        return self.json_schema not in (None, False) or self.grammar is not None

    def validate(self) -> "OutputConfig":
        if self.json_schema not in (None, False) and self.grammar is not None:
            raise OffspecError("give either a JSON schema or a grammar, not both")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise OffspecError("the grammar must be a non-empty string (a Lark grammar)")
        if self.json_schema not in (None, False, True) and not isinstance(self.json_schema, (dict, str)):
            raise OffspecError(f"the JSON schema must be a dict or JSON text, got {type(self.json_schema).__name__}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise OffspecError(f"logprobs must be a whole number of alternatives in 0..{MAX_TOP_LOGPROBS} (or None: "
                               f"off), got {self.logprobs!r}")
        return self


RING_SLOTS = 2  # device slots the streamed layers rotate through (>= 2: one computes while the next loads)
STAGING_BUFFERS = 2  # host staging buffers the SSD reader fills ahead of the copies (a CPU reading the files into
# its slots has this many slots more instead: reads ahead of the compute; 0 leaves one read ahead; CUDA keeps >= 1)
PREFILL_TOKENS = 512  # a prefill pass of at least this many tokens fits in the activation reserve (issue 12)
MIN_FIT_BUDGET = 64  # the smallest max_budget / max_context the loader lowers defaults to (fit_limits)
MIN_FIT_CONTEXT = 1024
LAST_FIT_CONTEXT = 512  # ... and down to this once the prefill reserve and the staging buffers are at their least
MIN_FIT_PREFILL = 128  # prefill passes of a streamed target: at least this many tokens each

# metadata of a config field that is no option of `offspec.load` / the CLI: set by offspec itself (the loader,
# tests, benchmarks); `split_options` refuses it by that name
INTERNAL = {"option": False}


@dataclass(frozen=True)
class OffloadConfig:
    """Where the target's decoder layers may live (offspec/offload), and the limits its caches are sized for.
    Sizes are bytes (`offspec.offload.config.read_options` reads "22GB"); None = derived from what is free."""

    device_mem: Optional[int] = None  # everything offspec puts on the device: resident parts, KV caches, slots
    ram_mem: Optional[int] = None  # host RAM for layers streamed from RAM (pinned on CUDA) and SSD staging
    quant: str = "none"  # a float target stored once as: none, int4 (ggml Q4_1), int8 (ggml Q8_0), nf4 (CUDA)
    draft_quant: str = "none"  # the same for a float draft (kept resident); a GGUF keeps its own format
    offload_dir: Optional[Path] = None  # packed per-layer files; None = <cache dir>/offload
    # a CPU's LM head: "auto" (read from SSD in every pass where the budget cannot keep it with every layer
    # streamed), "always" or "never" (offspec/offload/head.py)
    stream_head: str = "auto"
    # a mixture of experts that does not fit: "auto" keeps every layer's dense part resident and fetches its experts
    # as routed into an expert cache, where the budget holds one layer's experts beside them: from RAM where the RAM
    # budget holds them all (offspec/offload/ram_experts.py), else from SSD (offspec/offload/experts.py); "whole"
    # streams its layers whole, every expert of them, as a dense model's
    experts: str = "auto"
    expert_policy: str = "lru"  # which cached expert makes room: "lru" (least recently used) or "lfu" (least routed)
    expert_prefetch: str = "on"  # "on": read the next layer's predicted experts ahead (offspec/offload/experts.py)
    max_context: int = 4096  # tokens of conversation the caches hold (capped by the model's own limit)
    max_budget: int = 4096  # the largest tree budget a call may ask for (the KV caches reserve room for it)
    # tuning and what the loader derives (no options of offspec.load)
    ring_slots: int = field(default=RING_SLOTS, metadata=INTERNAL)
    staging_buffers: int = field(default=STAGING_BUFFERS, metadata=INTERNAL)
    # SSD reads with O_DIRECT (no page cache); falls back to buffered + DONTNEED
    direct_io: bool = field(default=True, metadata=INTERNAL)
    # checksum of each packed file: on its "first" read in a process, "always" or "never"
    verify: str = field(default="first", metadata=INTERNAL)
    pack_always: bool = field(default=False, metadata=INTERNAL)  # the packed store even when every layer fits
    # limits the user left at their defaults ("max_budget", "max_context"): where the resident parts would not fit
    # the device budget, the loader lowers them (budget first, to MIN_FIT_BUDGET / MIN_FIT_CONTEXT) and says so
    fit_limits: tuple[str, ...] = field(default=(), metadata=INTERNAL)
    min_budget: int = field(default=64, metadata=INTERNAL)  # never below the tree budget asked for
    # the smallest prefill pass the activation reserve must hold
    prefill_tokens: int = field(default=PREFILL_TOKENS, metadata=INTERNAL)
    # a CPU-resident LM head of its own interleaved for the kernels at load; off for a draft, whose head is reduced
    # first (interleaving 152k rows to drop most of them would cost a 0.5B draft 138 MB for a moment)
    interleave_head: bool = field(default=True, metadata=INTERNAL)

    def smaller_limits(self) -> Optional["OffloadConfig"]:
        """The next smaller max_budget / max_context this config may fall back to, or None."""
        floor = max(MIN_FIT_BUDGET, self.min_budget)
        if "max_budget" in self.fit_limits and self.max_budget > floor:
            return replace(self, max_budget=max(floor, self.max_budget // 2))
        if "max_context" in self.fit_limits and self.max_context > MIN_FIT_CONTEXT:
            return replace(self, max_context=max(MIN_FIT_CONTEXT, self.max_context // 2))
        # no option sets these two: lowered whatever the user gave, so that explicit limits never need more memory
        # than the defaults lowered to the same values
        if self.prefill_tokens > MIN_FIT_PREFILL:  # longer prompts then take more passes
            return replace(self, prefill_tokens=max(MIN_FIT_PREFILL, self.prefill_tokens // 2))
        if self.staging_buffers > 0:  # one read fewer ahead of the compute (CUDA's SSD path keeps one buffer)
            return replace(self, staging_buffers=self.staging_buffers - 1)
        if "max_context" in self.fit_limits and self.max_context > LAST_FIT_CONTEXT:  # the last resort
            return replace(self, max_context=max(LAST_FIT_CONTEXT, self.max_context // 2))
        return None

    def validate(self) -> "OffloadConfig":
        if not _is_int(self.max_context) or self.max_context <= 1:
            raise OffspecError(f"max_context must be a whole number > 1, got {self.max_context!r}; "
                               f"pass e.g. --max-context 4096")
        if not _is_int(self.max_budget) or self.max_budget <= 0:
            raise OffspecError(f"max_budget must be a positive whole number, got {self.max_budget!r}; "
                               f"pass e.g. --max-budget 512")
        for name in ("quant", "draft_quant"):
            if getattr(self, name) not in QUANTS:
                raise OffspecError(f"unknown {name} {getattr(self, name)!r}; use none, int4, int8 or nf4")
        if self.ring_slots < 2:
            raise OffspecError(f"ring_slots must be >= 2 (one slot computes while the next loads), "
                               f"got {self.ring_slots}")
        if self.staging_buffers < 0:
            raise OffspecError(f"staging_buffers must be >= 0, got {self.staging_buffers}")
        if self.verify not in ("first", "always", "never"):
            raise OffspecError(f"verify must be first, always or never, got {self.verify!r}")
        if self.stream_head not in ("auto", "always", "never"):
            raise OffspecError(f"stream_head must be auto, always or never, got {self.stream_head!r}")
        if self.experts not in ("auto", "whole"):
            raise OffspecError(f"experts must be auto or whole, got {self.experts!r}")
        if self.expert_policy not in ("lru", "lfu"):
            raise OffspecError(f"expert_policy must be lru or lfu, got {self.expert_policy!r}")
        if self.expert_prefetch not in ("on", "off"):
            raise OffspecError(f"expert_prefetch must be on or off, got {self.expert_prefetch!r}")
        return self


@dataclass(frozen=True)
class LoadConfig:
    """Which models to load, where and how. Built from `offspec.load`'s keywords (the CLI's flags) by field
    name, the offloading ones (device_mem, ram_mem, quant, draft_quant, offload_dir, stream_head, experts,
    expert_policy, expert_prefetch, max_context,
    max_budget) into `offload` (`split_options`)."""

    target: Optional[str] = None  # None = the built-in default target
    draft: Optional[str] = None  # None = the built-in default draft
    device: Optional[str] = None  # None = "cuda" when available, else "cpu"
    dtype: Optional[str] = None  # None = bfloat16 on CUDA, float32 on CPU
    attn_implementation: str = "sdpa"
    # the draft's LM head: "auto" (its 65,536 most frequent tokens where a ranks table knows its tokenizer, else
    # all), "full", or a token count (offspec/models/draft_vocab.py); the target always scores every token
    draft_vocab: Union[str, int] = "auto"
    # CPU threads of torch; None = auto: the cores other processes leave free, re-checked while generating
    threads: Optional[int] = None
    # offloading (the target's decoder layers: resident on the device -> host RAM -> SSD) and the cache limits
    offload: OffloadConfig = OffloadConfig()

    @property
    def max_context(self) -> int:
        return self.offload.max_context

    @property
    def max_budget(self) -> int:
        return self.offload.max_budget

    def validate(self) -> "LoadConfig":
        self.offload.validate()  # max_context and max_budget first, as the flags are listed
        if self.dtype not in (None, "float32", "bfloat16", "float16", "float64"):
            raise OffspecError(f"unknown dtype {self.dtype!r}; use float32, bfloat16 or float16")
        if self.threads is not None and (not _is_int(self.threads) or self.threads <= 0):
            raise OffspecError(f"threads must be a positive whole number (or auto), got {self.threads!r}")
        draft_vocab_setting(self.draft_vocab)  # one line for a bad value, before anything loads
        return self


def draft_vocab_setting(value: Union[str, int, None]) -> Union[str, int]:
    """"auto", "full" or a row count >= 1 from a flag or option value; anything else is one OffspecError line."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        raise OffspecError(f"draft_vocab must be auto, full or a token count, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "full"):
            return text
        try:
            n = int(text)
        except ValueError:
            raise OffspecError(f"draft_vocab must be auto, full or a token count like 32768, got {value!r}") from None
    if n < 1:
        raise OffspecError(f"draft_vocab must be a token count >= 1 (or auto / full), got {n}")
    return n


def generation_configs(options: dict[str, Any]) -> tuple[SamplingConfig, GenerationConfig]:
    """Validated sampling and generation settings from per-call options (`temperature`, `top_p`, `top_k`,
    `seed`, `max_new_tokens`, `stop`, `speculate`); unknown keys are an error. Cheap: callers check options
    with it before loading any model."""
    options = dict(options)
    if "stop" in options and not isinstance(options["stop"], str):
        options["stop"] = tuple(options["stop"] or ())
    sampling, generation = split_options(options, SamplingConfig, GenerationConfig)
    sampling.validate()
    sampling = replace(sampling, temperature=float(sampling.temperature), top_p=float(sampling.top_p))
    return sampling, generation.validate()


def budget_room_error(budget: int, max_budget: int) -> OffspecError:
    """A tree budget above the caches' reserved room: say which flag (and which Python option) raises it."""
    return OffspecError(f"budget {budget} is above max_budget {max_budget}; raise it with --max-budget {budget} "
                        f"(max_budget={budget} in offspec.load) or use a smaller budget")


def split_auto_budget(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Take budget="auto" (also what no budget means) out of load options: (options, is_auto).

    With auto, the tree is planned after loading (`offspec.profile.auto`); until then TreeConfig keeps its
    default budget, capped by max_budget."""
    if options.get("budget", AUTO_BUDGET) != AUTO_BUDGET:
        return options, False
    rest = {k: v for k, v in options.items() if k != "budget"}
    cap = rest.get("max_budget", OffloadConfig.max_budget)
    if isinstance(cap, int) and 0 < cap < TreeConfig.budget:
        rest["budget"] = cap
    return rest, True


def split_options(options: dict[str, Any], *classes: type) -> list[Any]:
    """Build one instance of each config class from a flat keyword dict, by field name; a field that holds a
    config (LoadConfig.offload) is built the same way from the options named as its fields. Unknown keys, and
    fields marked INTERNAL, are an error."""
    remaining = dict(options)
    built = [_build(cls, remaining) for cls in classes]
    if remaining:
        raise OffspecError(f"unknown option(s): {', '.join(sorted(remaining))}")
    return built


def option_names(*classes: type) -> tuple[str, ...]:
    """The option names of config classes, as `split_options` takes them (a nested config's options included)."""
    names: list[str] = []
    for cls in classes:
        for f in fields(cls):
            if is_dataclass(f.default):
                names.extend(option_names(type(f.default)))
            elif f.metadata.get("option", True):
                names.append(f.name)
    return tuple(names)


def _build(cls: type, remaining: dict[str, Any]) -> Any:
    kwargs = {}
    for f in fields(cls):
        if is_dataclass(f.default):  # a config within this one, e.g. LoadConfig.offload
            kwargs[f.name] = _build(type(f.default), remaining)
        elif f.name in remaining and f.metadata.get("option", True):
            kwargs[f.name] = remaining.pop(f.name)
    return cls(**kwargs)


def updated(config: Any, **changes: Any) -> Any:
    """`dataclasses.replace` that ignores None values (a CLI flag not given)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})
