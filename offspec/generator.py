"""The user-facing generator: prompts and chat messages in, text and statistics out.

`Generator.stream()` yields `TextDelta`s as soon as a pass accepts tokens, then one `GenerationResult`.
Multi-turn use is automatic: each call's tokens are compared with what the caches hold, and the
shared prefix is reused.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Iterator, Optional, Sequence

from offspec.spec.engine import SpeculativeEngine
from offspec.spec.grammar import TokenGrammar, grammar_tokenizer, json_schema_grammar, lark_grammar
from offspec.spec.sampling import TokenChooser
from offspec.util.device import sync_compute
from offspec.util.reasoning import HARMONY, ReasoningFormat, reasoning_format

from .config import GenerationConfig, OutputConfig, TreeConfig, budget_room_error, generation_configs
from .errors import OffspecError
from .types import GenerationResult, ModelInfo, PassStats, Prompt, StreamEvent, TextDelta, TokenLogprob

# what a chat message may carry (`reasoning_content`: an assistant's earlier reasoning, which templates such as
# Qwen3's show the model within a turn of tool calls)
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")


class Generator:
    def __init__(self, engine: SpeculativeEngine, tokenizer, eos_ids: set[int], info: ModelInfo,
                 tree: TreeConfig, generation: GenerationConfig = GenerationConfig()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.info = info
        self.tree = tree  # default tree shape; `budget=` per call overrides its budget
        # budget="auto": an adaptive policy (offspec.profile.adapt) choosing each pass's tree via next_tree() and
        # observing its PassStats; it applies to calls without `budget=` while `tree` is still its `base_tree`.
        # `policies`: one per available drafter (a call with `drafter=` and no `budget=` uses that one's)
        self.policy = None
        self.policies: dict = {}
        self.generation = generation
        # sizes torch's CPU threads to the cores other processes leave free, between passes (offspec.util.threads);
        # None: the thread count stays as it is (CUDA, or threads fixed by the user)
        self.threads = None
        self._lock = threading.Lock()  # one generation at a time: the caches are shared state
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, built at the first constrained call
        # how the model writes its reasoning (offspec.util.reasoning), from its chat template; None: it does not.
        # Its markers stay in the decoded text even where they are special tokens, so that the CLI, the chat and
        # the server can split the reasoning from the answer
        self.reasoning: Optional[ReasoningFormat] = template_reasoning(tokenizer)
        self._hidden = _hidden_special_ids(tokenizer, self.reasoning)

    # --- text <-> tokens -------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Raw text -> token ids, without the chat template (a plain completion prompt: `raw=True`, `offspec
        generate --raw`, /v1/completions), with the special tokens the tokenizer adds to any text (a BOS), as
        llama.cpp tokenizes a prompt."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode(self, prompt: Prompt, raw: bool = False, tools: Optional[Sequence[dict]] = None) -> list[int]:
        """A string is sent as one user message through the chat template (when the tokenizer has one), or as it
        is with `raw` (`tokenize`); a sequence of token ids is used as it is. `tools` (function definitions, as
        OpenAI's API gives them) go to the chat template, which shows them to the model; messages may carry
        `tool_calls` (an assistant's) and `tool_call_id` (a tool's answer), as the template renders them."""
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise OffspecError("the prompt is empty; give at least one message or token")
        if raw and isinstance(prompt, str):
            return self.tokenize(prompt)
        if raw and not _is_token_ids(prompt):
            raise OffspecError("raw=True takes a text prompt (or token ids), not chat messages")
        if _is_token_ids(prompt):
            vocab = self.engine.target.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise OffspecError(f"token ids must be in [0, {vocab}) (the model's vocabulary); the prompt holds "
                                   f"one outside that range")
            return [int(t) for t in prompt]
        if isinstance(prompt, str):
            if not getattr(self.tokenizer, "chat_template", None) and not tools:
                return self.tokenize(prompt)
            prompt = [{"role": "user", "content": prompt}]
        try:
            messages = [{k: m[k] for k in MESSAGE_FIELDS if k in m} for m in prompt]
            if not all("role" in m and ("content" in m or "tool_calls" in m) for m in messages):
                raise KeyError
        except (KeyError, TypeError):
            raise OffspecError("messages must be a list of {'role': ..., 'content': ...} dicts") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise OffspecError("this model's tokenizer has no chat template; pass a plain string prompt")
        if self.reasoning is not None and self.reasoning.kind == HARMONY:  # gpt-oss's template reads it as `thinking`
            messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
        extra = {"tools": list(tools)} if tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        except Exception as exc:  # the template's own checks (jinja's raise_exception), or one it cannot render
            raise OffspecError(f"the chat template cannot render these messages: {exc}") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def checked_ids(self, ids: list[int]) -> list[int]:
        """`ids` if every one has a row in the target's embedding; else one OffspecError naming the first that does
        not (a tokenizer with tokens past the model's vocabulary), before any reaches the model."""
        vocab = self.engine.target.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise OffspecError(f"the tokenizer gave token id {t} ({_token_name(self.tokenizer, t)}) at position "
                                   f"{i} of the prompt, outside the model's vocabulary of {vocab} ids; the tokenizer "
                                   f"does not match the model: report it, or pass the prompt as token ids")
        return ids

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Token ids -> text, without special tokens (with them: `special`, as tool-call markers can be) but the
        reasoning's markers (`self.reasoning.markers`)."""
        if special or self._hidden is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=not special)
        return self.tokenizer.decode([t for t in ids if t not in self._hidden], skip_special_tokens=False)

    def close(self) -> None:
        """Release a streamed target's ring slots, staging buffers and RAM-tier copies (pinned host memory on
        CUDA) now rather than when the generator is garbage collected; it cannot generate afterwards."""
        io = self.engine.target.io
        if io is not None and hasattr(io, "close"):
            io.close()

    # --- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        result = None
        for event in self.stream(prompt, **kwargs):
            if isinstance(event, GenerationResult):
                result = event
        return result

    def stream(self, prompt: Prompt, *, max_new_tokens: Optional[int] = None, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, budget: Optional[int] = None, seed: Optional[int] = None,
               speculate: Optional[bool] = None, stop: Sequence[str] = (),
               cancel: Optional[threading.Event] = None, drafter: Optional[str] = None,
               raw: bool = False, json_schema=None, grammar: Optional[str] = None, logprobs: Optional[int] = None,
               tools: Optional[Sequence[dict]] = None) -> Iterator[StreamEvent]:
        """Yield TextDeltas, then the GenerationResult. `budget`, `drafter` (model, suffix or hybrid): this
        call's tree instead of the generator's own (and its `budget="auto"` planning). `raw`: a text prompt is
        tokenized as it is, without the chat template (`encode`). `json_schema` (a dict or its JSON text; True: any
        JSON object) or `grammar` (a Lark grammar): the output follows it, every token masked to what it allows,
        speculation on. `logprobs`: each token's log-probability and that many alternatives' (0-20) in the events
        and the result. `tools`: function definitions shown to the model through the chat template."""
        sampling, gen = generation_configs(dict(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            max_new_tokens=self.generation.max_new_tokens if max_new_tokens is None else max_new_tokens,
            speculate=self.generation.speculate if speculate is None else bool(speculate)))
        output = OutputConfig(json_schema=json_schema, grammar=grammar, logprobs=logprobs).validate()
        tree = self.tree if budget is None else replace(self.tree, budget=budget)
        policy = self.policy if tree is self.tree and getattr(self.policy, "base_tree", None) is self.tree else None
        if drafter is not None and drafter != tree.drafter:
            policy = self.policies.get(drafter) if budget is None else None
            tree = policy.base_tree if policy is not None else replace(tree, drafter=drafter)
        tree.validate()
        self.engine.drafter.check_mode(tree.drafter)  # e.g. "model" without a draft model: one clear error
        if tree.budget > self.engine.max_budget:
            raise budget_room_error(tree.budget, self.engine.max_budget)
        prompt_ids = self.checked_ids(self.encode(prompt, raw, tools))
        if not self._lock.acquire(blocking=False):
            raise OffspecError("a generation is already running on this generator; wait for it or cancel it")
        try:
            chooser = TokenChooser(sampling, self.engine.target.device, self._grammar(output), output.logprobs)
            yield from self._run(prompt_ids, chooser, gen, tree, cancel, policy)
        finally:
            self._lock.release()

    def _grammar(self, output: OutputConfig) -> Optional[TokenGrammar]:
        """The output's grammar at its start (None: unconstrained)."""
        if not output.constrained:
            return None
        spec = json_schema_grammar(output.json_schema) if output.grammar is None else lark_grammar(output.grammar)
        return TokenGrammar(self.grammar_tokenizer(), spec, self.engine.target.vocab_size)

    def grammar_tokenizer(self):
        """llguidance's view of the target's tokenizer (built once, 1-3 s for 152k tokens)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.engine.target.vocab_size, self.eos_ids)
        return self._grammar_tokenizer

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (part of a character, possibly), as OpenAI's logprobs give them."""
        return self.grammar_tokenizer().decode_bytes([int(token)])

    def _run(self, prompt_ids: list[int], chooser: TokenChooser, gen: GenerationConfig, tree: TreeConfig,
             cancel: Optional[threading.Event], policy=None) -> Iterator[StreamEvent]:
        engine = self.engine
        start = time.perf_counter()
        reused = engine.reset_to(prompt_ids)
        sync_compute(engine.target.device)  # sync: once a call, so that the prompt's time ends with its last layer
        prefill_seconds = time.perf_counter() - start
        out: list[int] = []
        recorded = chooser.logprobs  # the chooser's records: one per token a pass emitted, in order
        logprobs: list[TokenLogprob] = []  # those of `out`'s tokens
        passes: list[PassStats] = []
        text_sent = ""
        stop_reason = None
        while stop_reason is None:
            if cancel is not None and cancel.is_set():
                stop_reason = "cancelled"
                break
            if engine.room <= 0:
                stop_reason = "context"
                break
            if self.threads is not None and self.threads.update():
                self.info.extra["threads"] = self.threads.summary()
                if policy is not None:
                    policy.reset_timing()  # another thread count: earlier pass times no longer apply
            if gen.speculate and (policy is None or policy.use_tree()):
                step_tree = policy.next_tree(tree) if policy is not None else tree
                new, stats = engine.speculative_step(step_tree, chooser, snapshot=True)
            else:
                new, stats = engine.autoregressive_step(chooser)
            if policy is not None and gen.speculate:
                policy.observe(stats)  # budget="auto": acceptance and timing statistics, re-plans on drift
            # Cut at EOS, at max_new_tokens and at the context limit; the caches may hold more, which the
            # next call's prefix match discards.
            keep = len(new)
            for i, t in enumerate(new):
                if t in self.eos_ids:
                    keep, stop_reason = i, "eos"
                    break
            if len(out) + keep >= gen.max_new_tokens:
                keep, stop_reason = gen.max_new_tokens - len(out), stop_reason or "max_tokens"
            room = self.engine.max_context - len(prompt_ids) - len(out)
            if keep >= room:
                keep, stop_reason = room, stop_reason or "context"
            out.extend(new[:keep])
            pass_logprobs = tuple(recorded[len(recorded) - len(new) :][:keep]) if recorded else ()
            logprobs.extend(pass_logprobs)
            stats = replace(stats, emitted=keep) if keep != len(new) else stats
            passes.append(stats)
            text = self.decode(out)
            cut = _find_stop(text, gen.stop)
            if cut is not None:
                text, stop_reason = text[:cut], "stop"
                out = _trim_ids_to_text(self, out, text)
                del logprobs[len(out) :]
            # one event per pass (the UI wants every pass's statistics), with the text that is safe to show
            visible = _safe_prefix(text, gen.stop, final=stop_reason is not None)
            delta = ""
            if len(visible) > len(text_sent) and visible.startswith(text_sent):
                delta, text_sent = visible[len(text_sent):], visible
            yield TextDelta(text=delta, token_ids=tuple(new[:keep]), stats=stats, logprobs=pass_logprobs)
        text = self.decode(out)
        cut = _find_stop(text, gen.stop)
        if cut is not None:
            text = text[:cut]
        if len(text) > len(text_sent) and text.startswith(text_sent):
            yield TextDelta(text=text[len(text_sent):], token_ids=(), stats=None)
        # keep the tree snapshot of the last pass that grew a tree only: the UI shows it, and long runs stay small
        last_tree = max((i for i, p in enumerate(passes) if p.tree is not None), default=-1)
        passes = [p if i == last_tree or p.tree is None else replace(p, tree=None) for i, p in enumerate(passes)]
        yield GenerationResult(text=text, token_ids=out, passes=passes, seconds=time.perf_counter() - start,
                               stop_reason=stop_reason, prompt_tokens=len(prompt_ids), reused_prompt_tokens=reused,
                               prefill_seconds=prefill_seconds,
                               logprobs=logprobs if chooser.top_logprobs is not None else None)


def template_reasoning(tokenizer) -> Optional[ReasoningFormat]:
    """The reasoning format of the tokenizer's chat template, and whether its generation prompt opens the
    reasoning (rendered for one user message: offspec passes a template no options, so every chat's is the same)."""
    template = getattr(tokenizer, "chat_template", None)
    found = reasoning_format(template)
    if found is None:
        return None
    probe = [{"role": "user", "content": "Hi"}]
    try:
        whole = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        before = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    except Exception:  # a template that cannot render one user message renders no chat: encode() says why then
        return found
    if not isinstance(whole, str) or not isinstance(before, str):
        return found
    return reasoning_format(template, whole[len(before):] if whole.startswith(before) else whole)


def _hidden_special_ids(tokenizer, fmt: Optional[ReasoningFormat]) -> Optional[set[int]]:
    """The special tokens `decode` leaves out where some of the reasoning's markers are special tokens (gpt-oss's
    `<|channel|>`, ...); None where none is (decoding skips special tokens as usual)."""
    if fmt is None:
        return None
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
    special |= {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    kept = {int(i) for i, t in added.items() if str(t) in fmt.markers} & special
    return special - kept if kept else None


def _token_name(tokenizer, token: int) -> str:
    """A token's text for an error message (repr'd, so that spaces and newlines show), or "unknown"."""
    try:
        name = tokenizer.convert_ids_to_tokens(int(token))
    except Exception:  # an id the tokenizer does not know either
        name = None
    return repr(name) if isinstance(name, str) else "unknown to the tokenizer"


def _is_token_ids(prompt: Prompt) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def _find_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: Sequence[str], final: bool) -> str:
    """The part of `text` that can be shown now: hold back an unfinished multi-byte character and any
    tail that could be the start of a stop string."""
    if final:
        return text
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return text[:end]


def _trim_ids_to_text(gen: Generator, ids: list[int], text: str) -> list[int]:
    """The shortest prefix of `ids` whose decoded text covers `text` (used when a stop string cuts)."""
    for i in range(len(ids) + 1):
        if len(gen.decode(ids[:i])) >= len(text):
            return ids[:i]
    return ids
