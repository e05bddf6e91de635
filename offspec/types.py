"""What loading gives and what the engine and the generator return: a loaded model, per-pass statistics, results
and stream events.

Engines never print; everything a UI or a benchmark wants to show comes through these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, Union


@dataclass(frozen=True)
class TreeSnapshot:
    """The tree of one pass, for display. Node 0 is the root (the last committed token)."""

    tokens: tuple[int, ...]  # token id per node
    parents: tuple[int, ...]  # parent node index per node (-1 for the root)
    accepted: tuple[int, ...]  # node indices of the accepted path, root first
    bonus_token: int  # the target's own token emitted after the accepted path


@dataclass(frozen=True)
class PassStats:
    """One target pass (or one autoregressive step when not speculating)."""

    tree_size: int  # draft tokens verified in this pass (0 when not speculating)
    accepted: int  # tree tokens the target agreed with
    emitted: int  # tokens this pass added to the output (accepted + 1, fewer when a stop condition cut it)
    draft_seconds: float  # drafting: growing the tree with the draft model
    target_seconds: float  # the target's forward pass and the acceptance walk
    budget: int  # tree budget asked for in this pass
    depth_counts: tuple[int, ...] = ()  # tree nodes at depth 1, 2, ...
    io_wait_seconds: float = 0.0  # part of target_seconds spent waiting for streamed weights (offloading)
    bytes_streamed: int = 0  # weight bytes streamed to the device for this pass
    tree: Optional[TreeSnapshot] = None  # filled in for the last pass of a call (for the UI's tree panel)
    drafter: str = ""  # what built the tree: "model", "suffix" or "hybrid" ("" when not speculating)
    caught_up: int = 0  # committed tokens the draft model processed first (its cache lagged), 0 if it did not run
    grown_nodes: int = 0  # nodes past the budget the draft added while the first streamed layer loaded (grow_nodes)
    experts_routed: int = 0  # a mixture whose experts are read as routed: the (layer, expert) pairs this pass ran
    expert_hits: int = 0  # of them, those the expert cache held (the others were read from SSD or RAM)

    @property
    def stream_bandwidth(self) -> float:
        """Achieved weight-streaming bandwidth of this pass, bytes/s over the whole target pass (0 if none)."""
        return self.bytes_streamed / self.target_seconds if self.bytes_streamed and self.target_seconds > 0 else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution (its logits' log-softmax, before a
    grammar's mask and the sampling settings), and the likeliest tokens' there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability) of the likeliest tokens

    def summary(self) -> dict:
        return {"token": self.token, "logprob": round(self.logprob, 6),
                "top": [[t, round(lp, 6)] for t, lp in self.top]}


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    passes: list[PassStats]
    seconds: float  # wall time of the decode (prefill included)
    stop_reason: str  # "eos", "stop", "max_tokens", "context", "cancelled"
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV cache was reused from the previous call
    # the target's forward over the prompt's uncached tokens but its last (which the first pass takes), in
    # `seconds`; a draft model catches up on the prompt in its first pass, counted after it
    prefill_seconds: float = 0.0
    logprobs: Optional[list[TokenLogprob]] = None  # one per token of `token_ids`, when asked for

    @property
    def n_passes(self) -> int:
        return len(self.passes)

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / len(self.passes) if self.passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens the prefill ran (the last one goes into the first pass)."""
        return max(0, self.prompt_tokens - 1 - self.reused_prompt_tokens)

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens a second after the prompt's prefill: what llama.cpp's `tg` (and its "eval time") measures."""
        decode = self.seconds - self.prefill_seconds
        return len(self.token_ids) / decode if decode > 0 else 0.0

    @property
    def draft_seconds(self) -> float:
        return sum(p.draft_seconds for p in self.passes)

    @property
    def target_seconds(self) -> float:
        return sum(p.target_seconds for p in self.passes)

    def summary(self) -> dict:
        """The JSON-friendly view used by `offspec generate --json`."""
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "passes": self.n_passes,
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "stop_reason": self.stop_reason,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            **({"logprobs": [lp.summary() for lp in self.logprobs]} if self.logprobs is not None else {}),
            "io_wait_seconds": round(sum(p.io_wait_seconds for p in self.passes), 4),
            "bytes_streamed": sum(p.bytes_streamed for p in self.passes),
            "per_pass": [
                {"tree_size": p.tree_size, "accepted": p.accepted, "emitted": p.emitted,
                 "draft_seconds": round(p.draft_seconds, 5), "target_seconds": round(p.target_seconds, 5),
                 "io_wait_seconds": round(p.io_wait_seconds, 5), "bytes_streamed": p.bytes_streamed,
                 "stream_gb_per_s": round(p.stream_bandwidth / 1e9, 3), "grown_nodes": p.grown_nodes}
                for p in self.passes
            ],
        }


@dataclass(frozen=True)
class TextDelta:
    """New text accepted by a pass. `stats` is that pass's statistics."""

    text: str
    token_ids: tuple[int, ...]
    stats: Optional[PassStats] = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of `token_ids`, when asked for


StreamEvent = Union[TextDelta, GenerationResult]  # a stream yields TextDelta..., then one GenerationResult

Messages = Sequence[dict]  # [{"role": "user", "content": "..."}, ...]
Prompt = Union[str, Messages, Sequence[int]]  # text (through the chat template), chat messages, or token ids


@dataclass(frozen=True)
class ModelInfo:
    """What a UI shows about the loaded pair."""

    target: str
    draft: str
    device: str
    dtype: str
    max_context: int
    default_budget: int
    extra: dict = field(default_factory=dict)


class GeneratorLike(Protocol):
    """What the CLI and the TUI need from a generator (the real one is `offspec.generator.Generator`)."""

    info: ModelInfo

    def stream(self, prompt: Prompt, *, max_new_tokens: int = ..., temperature: float = ..., top_p: float = ...,
               top_k: int = ..., budget: Optional[int] = ..., seed: Optional[int] = ..., speculate: bool = ...,
               stop: Sequence[str] = ..., cancel=None, drafter: Optional[str] = ...,
               raw: bool = ..., json_schema: Any = ..., grammar: Optional[str] = ...,
               logprobs: Optional[int] = ..., tools: Optional[Sequence[dict]] = ...) -> Iterator[StreamEvent]: ...

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult: ...


@dataclass
class LoadedModel:
    """A model ready to run: eval mode, on its device, no gradients."""

    name: str
    path: Path
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    offload: Any = None  # offloading (offspec.offload.OffloadHandle): placement and layer streamer of a target
    borrows_kv: bool = False  # a draft made from the target (`--draft self`): it reads the target's KV cache
