"""A scripted generator with the real one's interface, for tests and for trying the UI without models.

It streams the words of a scripted reply a few tokens per pass, with small PassStats (tree included),
records every call, and can hold between passes until the caller cancels (deterministic cancel tests).
`reasoning` stands for the format a real generator reads from its chat template (e.g. `<think>` blocks in the
scripted reply are then the model's reasoning).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

from offspec.progress import ProgressEvent, ProgressFn
from offspec.types import GenerationResult, ModelInfo, PassStats, StreamEvent, TextDelta, TreeSnapshot
from offspec.util.reasoning import ReasoningFormat

DEFAULT_REPLY = ("Here is a reply with **Markdown** and code:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
                 "Speculative decoding verifies a whole tree of drafted tokens in one target pass.")


@dataclass(frozen=True)
class FakePassStats(PassStats):
    """PassStats with the weight-streaming fields the engine is getting."""

    io_wait_seconds: float = 0.0
    bytes_streamed: int = 0


def split_tokens(text: str) -> list[str]:
    """Words with their leading spaces, newlines kept: a crude but reversible tokenization."""
    tokens, current = [], ""
    for ch in text:
        if (ch in " \n" and current.strip()) or current.endswith("\n"):
            tokens.append(current)
            current = ""
        current += ch
    if current:
        tokens.append(current)
    return tokens


class FakeGenerator:
    """`reply` is the text of every reply, or a function of the messages that returns it."""

    def __init__(self, reply: Union[str, Callable[[list], str]] = DEFAULT_REPLY, *, tokens_per_pass: int = 3,
                 pass_seconds: float = 0.0, hold_after_passes: Optional[int] = None, budget_source: str = "profile",
                 default_budget: int = 32, device: str = "cpu", io_fraction: float = 0.6,
                 gate: Optional[threading.Semaphore] = None, reasoning: Optional[ReasoningFormat] = None):
        self.reply = reply
        self.reasoning = reasoning  # as offspec.Generator.reasoning
        self.tokens_per_pass = tokens_per_pass
        self.pass_seconds = pass_seconds
        self.hold_after_passes = hold_after_passes  # after this many passes, wait for `cancel` before going on
        self.io_fraction = io_fraction
        self.gate = gate  # when set, each pass first takes one permit (tests release passes one by one)
        self.info = ModelInfo(target="fake-target", draft="fake-draft", device=device, dtype="float32",
                              max_context=4096, default_budget=default_budget,
                              extra={"budget_source": budget_source})
        self.calls: list[dict] = []  # the prompt and keyword arguments of every stream() call
        self.holding = threading.Event()  # set while held between passes, waiting for cancel
        self._vocab: dict[str, int] = {}
        self._words: list[str] = []

    # -- token ids ---------------------------------------------------------------------------

    def _id(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._words)
            self._words.append(token)
        return self._vocab[token]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self._words[i] if 0 <= i < len(self._words) else f"<{i}>" for i in token_ids)

    # -- GeneratorLike -----------------------------------------------------------------------

    def stream(self, prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, budget: Optional[int] = None, seed: Optional[int] = None, speculate: bool = True,
               stop: Sequence[str] = (), cancel: Optional[threading.Event] = None,
               drafter: Optional[str] = None) -> Iterator[StreamEvent]:
        self.calls.append(dict(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, budget=budget, seed=seed, speculate=speculate, stop=tuple(stop),
                               drafter=drafter))
        text = self.reply(list(prompt)) if callable(self.reply) else self.reply
        tokens = split_tokens(text)[:max_new_tokens]
        budget_used = budget if budget is not None else self.info.default_budget
        started = time.monotonic()
        out_text, out_ids, passes = "", [], []
        stop_reason = "max_tokens" if len(split_tokens(text)) > max_new_tokens else "eos"
        for start in range(0, len(tokens), self.tokens_per_pass):
            if self.hold_after_passes is not None and len(passes) >= self.hold_after_passes and cancel is not None:
                self.holding.set()
                cancel.wait(timeout=30)
            if cancel is not None and cancel.is_set():
                stop_reason = "cancelled"
                break
            if self.gate is not None and not self.gate.acquire(timeout=30):
                stop_reason = "cancelled"
                break
            if self.pass_seconds:
                time.sleep(self.pass_seconds)
            piece = tokens[start:start + self.tokens_per_pass]
            ids = tuple(self._id(t) for t in piece)
            stats = self._stats(ids, out_ids[-1] if out_ids else self._id("<root>"), budget_used)
            passes.append(stats)
            out_text += "".join(piece)
            out_ids.extend(ids)
            yield TextDelta("".join(piece), ids, stats)
        self.holding.clear()
        yield GenerationResult(text=out_text, token_ids=out_ids, passes=passes,
                               seconds=max(time.monotonic() - started, 1e-6), stop_reason=stop_reason,
                               prompt_tokens=sum(len(str(m.get("content", ""))) for m in prompt)
                               if not isinstance(prompt, str) else len(prompt))

    def generate(self, prompt, **kwargs) -> GenerationResult:
        *_, result = self.stream(prompt, **kwargs)
        return result

    def _stats(self, ids: tuple[int, ...], root: int, budget: int) -> FakePassStats:
        """A small tree: the accepted chain with two rejected siblings at each depth, and two rejected
        drafts (one with a child) where the target chose its bonus token instead."""
        accepted = ids[:-1]  # the last token of the pass is the target's bonus token
        tokens, parents, path = [root], [-1], [0]
        for depth, token in enumerate(accepted):
            parent = path[-1]
            for k in (1, 2):
                tokens.append(self._id(f"<alt{depth}.{k}>"))
                parents.append(parent)
            tokens.append(token)
            parents.append(parent)
            path.append(len(tokens) - 1)
        end = path[-1]
        for k in (1, 2):
            tokens.append(self._id(f"<rejected{k}>"))
            parents.append(end)
        tokens.append(self._id("<deeper>"))
        parents.append(len(tokens) - 2)
        tree = TreeSnapshot(tuple(tokens), tuple(parents), tuple(path), ids[-1])
        target = 0.010
        return FakePassStats(tree_size=len(tokens) - 1, accepted=len(accepted), emitted=len(ids),
                             draft_seconds=0.002, target_seconds=target, budget=budget,
                             depth_counts=tuple(3 for _ in accepted) + (2, 1), tree=tree,
                             io_wait_seconds=target * self.io_fraction, bytes_streamed=50_000_000)


def fake_factory(generator: Optional[FakeGenerator] = None, *, steps: Sequence[str] = ("load", "warmup"),
                 step_seconds: float = 0.0, fail: Optional[BaseException] = None) -> Callable[[ProgressFn], FakeGenerator]:
    """A generator factory for ChatApp that reports progress for `steps`, then returns `generator` or raises `fail`."""

    def factory(progress: ProgressFn) -> FakeGenerator:
        for i, step in enumerate(steps):
            for done in range(5):
                progress(ProgressEvent(step, f"{step} (fake)", done=done, total=4))
                if step_seconds:
                    time.sleep(step_seconds / 5)
                if fail is not None and i == len(steps) - 1 and done == 2:
                    raise fail  # fails halfway through the last step
            progress(ProgressEvent(step, f"{step} (fake)", done=4, total=4, finished=True))
        return generator or FakeGenerator()

    return factory
