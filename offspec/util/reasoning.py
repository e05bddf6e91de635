"""A model's reasoning apart from its answer: which markers its chat template uses, and a streaming splitter.

Two ways of reasoning are known, both recognized in the chat template's text (as llama.cpp recognizes them):
- think (`</think>` in the template: Qwen3, QwQ, DeepSeek-R1's distills, SmolLM3, GLM, ...): a block
  `<think>\\n...\\n</think>\\n\\n` at the start of the output, then the answer. Only a block at the very start is
  reasoning; a `<think>` later in the answer is the answer's own text.
- harmony (`<|channel|>` in the template: gpt-oss): messages `<|channel|>NAME<|message|>...<|end|>`, the next one
  after `<|start|>assistant`. The analysis channel is the reasoning; the final channel and commentary without a
  recipient (a preamble) are the answer; a message to a recipient (` to=functions.f`, a tool call) stays in the
  answer verbatim, framing included, since offspec does not read harmony's tool calls.
A template with neither has no format: its output is the answer, untouched.

The generation prompt may open the block itself (QwQ's and Qwen3-Thinking-2507's end with `<think>\\n`): the output
then starts inside the reasoning (`ReasoningFormat.inside`), and a `<think>` the model writes again is dropped. An
`enable_thinking=False` prompt that holds an empty, closed block does not count as open, nor does the prompt of an
output held to a grammar from its first token (`held_from_start`).

Whitespace: think reasoning is stripped at both ends and the answer's whitespace after `</think>` dropped (as Qwen3's
template reads a reply back); harmony bodies are kept as written, two messages of one kind joined by a blank line.
A streamed split always equals the split of the whole text, however the text was cut into pieces.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

THINK, HARMONY = "think", "harmony"
OPEN, CLOSE = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what ends a harmony message (the last two also end the output)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_.-]+)")


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model writes its reasoning: `kind` (THINK or HARMONY), and whether its generation prompt opens the
    reasoning block (`inside`: the output starts in the reasoning)."""

    kind: str
    inside: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker strings the splitter reads: they must reach it as text (a tokenizer that holds them as
        special tokens would leave them out of decoded text)."""
        return (OPEN, CLOSE) if self.kind == THINK else (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)


def reasoning_format(template: Any, generation_prompt: str = "") -> Optional[ReasoningFormat]:
    """The format a chat template's model reasons in, or None (no reasoning markers: no split). `template`: the
    tokenizer's chat_template (a string, or transformers' dict/list of named templates); `generation_prompt`: what
    the template adds for the reply (for `inside`)."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template)
    if CHANNEL in text:
        return ReasoningFormat(HARMONY, _opens_harmony(generation_prompt))
    if CLOSE in text:
        return ReasoningFormat(THINK, generation_prompt.rfind(OPEN) > generation_prompt.rfind(CLOSE))
    return None


def held_from_start(fmt: Optional[ReasoningFormat]) -> Optional[ReasoningFormat]:
    """The format of an output held to a grammar from its first token (a JSON schema, a forced tool call): it is not
    inside a block its prompt opened, since the grammar gives it no way to close one; a block it writes is still
    split."""
    return replace(fmt, inside=False) if fmt is not None and fmt.inside else fmt


def _opens_harmony(prompt: str) -> bool:
    """Whether `prompt` ends inside an analysis message (its body begun and not ended)."""
    body = prompt.rfind(MESSAGE)
    if body < 0 or any(prompt.rfind(end) > body for end in ENDS):
        return False
    found = _CHANNEL_NAME.search(prompt, max(prompt.rfind(START, 0, body), 0), body)
    return found is not None and found.group(1) == "analysis"


@dataclass(frozen=True)
class Split:
    """A piece of output (or a whole one) split: its reasoning and its answer."""

    reasoning: str = ""
    answer: str = ""


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the beginning (not the whole) of one of `markers`."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-k:]) and len(m) > k for m in markers):
            return k
    return 0


def _is_prefix(text: str, markers: tuple[str, ...]) -> bool:
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


class ReasoningSplitter:
    """Feed the output's text in pieces (`feed`), then `finish`: each gives the reasoning and the answer that can be
    shown now. Text that could be the beginning of a marker waits for the next piece. `fmt` None: everything is
    the answer, as it comes."""

    def __init__(self, fmt: Optional[ReasoningFormat]):
        self.fmt = fmt
        self._held = ""  # text read but not given out yet (a marker's beginning, whitespace that may be trailing)
        self._reasoning: list[str] = []
        self._answer: list[str] = []
        self._steps = {"plain": self._plain, "think-start": self._think_start, "think-lead": self._think_lead,
                       "think-body": self._think_body, "think-after": self._think_after,
                       "harmony-start": self._harmony_start, "harmony-header": self._harmony_header,
                       "harmony-body": self._harmony_body, "harmony-between": self._harmony_start}
        inside = fmt is not None and fmt.inside
        self._repeat = inside  # a `<think>` the model writes again after a prompt that opened one: dropped
        self._to = "reasoning" if inside else "answer"  # where the harmony message being read goes
        self._raw = False  # that message has a recipient (a tool call): kept verbatim, framing included
        self._said = {"reasoning": False, "answer": False}  # whether a harmony message of that kind had text
        self._gap = False  # a blank line is due before this message's first text
        if fmt is None:
            self._state = "plain"
        elif fmt.kind == THINK:
            self._state = "think-lead" if inside else "think-start"
        else:
            self._state = "harmony-body" if inside else "harmony-start"

    def feed(self, text: str) -> Split:
        self._held += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Split:
        """What is left once the output is whole (an unclosed block's reasoning, held text)."""
        self._run(final=True)
        return self._take()

    def _take(self) -> Split:
        split = Split("".join(self._reasoning), "".join(self._answer))
        self._reasoning, self._answer = [], []
        return split

    def _run(self, final: bool) -> None:
        # each state's step reads `_held` and returns True when it moved to another state, which reads on
        while self._steps[self._state](final):
            pass

    def _plain(self, final: bool) -> bool:
        self._answer.append(self._held)
        self._held = ""
        return False

    # -- think --------------------------------------------------------------------------------------------------

    def _think_start(self, final: bool) -> bool:
        """Before the output's first text: a `<think>` here opens the reasoning, anything else is the answer."""
        rest = self._held.lstrip()
        if rest.startswith(OPEN):
            self._held, self._state = rest[len(OPEN):], "think-lead"
            return True
        if not final and (not rest or _is_prefix(rest, (OPEN,))):
            return False
        self._state = "plain"  # the answer, untouched (its leading whitespace too)
        return True

    def _think_lead(self, final: bool) -> bool:
        """The reasoning's leading whitespace is dropped, and a repeated `<think>`."""
        self._held = self._held.lstrip()
        if self._repeat:
            if self._held.startswith(OPEN):
                self._held, self._repeat = self._held[len(OPEN):], False
                return True
            if not final and (not self._held or _is_prefix(self._held, (OPEN,))):
                return False
        if not self._held:
            return False
        self._repeat, self._state = False, "think-body"
        return True

    def _think_body(self, final: bool) -> bool:
        end = self._held.find(CLOSE)
        if end >= 0:
            self._add(self._reasoning, self._held[:end].rstrip())
            self._held, self._state = self._held[end + len(CLOSE):], "think-after"
            return True
        if final:
            self._add(self._reasoning, self._held.rstrip())
            self._held = ""
            return False
        shown = self._held[:len(self._held) - _partial(self._held, (CLOSE,))].rstrip()  # trailing whitespace waits:
        self._add(self._reasoning, shown)  # it may be the block's last
        self._held = self._held[len(shown):]
        return False

    def _think_after(self, final: bool) -> bool:
        """After `</think>`: the whitespace before the answer is dropped."""
        self._held = self._held.lstrip()
        if not self._held:
            return False
        self._state = "plain"
        return True

    @staticmethod
    def _add(out: list[str], text: str) -> None:
        if text:
            out.append(text)

    # -- harmony ------------------------------------------------------------------------------------------------

    def _harmony_start(self, final: bool) -> bool:
        """Before the first message and after each: its framing, or (output that is not harmony) the answer's own
        text, untouched."""
        if self._held.startswith((START, CHANNEL)):
            self._state = "harmony-header"
            return True
        if not final and (not self._held or _is_prefix(self._held, (START, CHANNEL))):
            return False
        self._state = "plain"
        return True

    def _harmony_header(self, final: bool) -> bool:
        """`<|start|>assistant<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>`: where the body goes."""
        end = self._held.find(MESSAGE)
        if end < 0:
            if final:
                self._held = ""  # a header cut short (max_tokens): framing without text
            return False
        header = self._held[:end]
        channel = _CHANNEL_NAME.search(header)
        self._raw = " to=" in header
        analysis = channel is not None and channel.group(1) == "analysis"
        self._to = "reasoning" if analysis and not self._raw else "answer"
        self._gap = self._said[self._to] and not self._raw
        if self._raw:
            self._answer.append(self._held[:end + len(MESSAGE)])
        self._held, self._state = self._held[end + len(MESSAGE):], "harmony-body"
        return True

    def _harmony_body(self, final: bool) -> bool:
        ends = [(i, m) for m in ENDS if (i := self._held.find(m)) >= 0]
        if ends:
            i, marker = min(ends)
            self._harmony_text(self._held[:i])
            if self._raw:
                self._answer.append(marker)
            self._held, self._state, self._raw = self._held[i + len(marker):], "harmony-between", False
            return True
        cut = len(self._held) if final else len(self._held) - _partial(self._held, ENDS)
        self._harmony_text(self._held[:cut])
        self._held = self._held[cut:]
        return False

    def _harmony_text(self, text: str) -> None:
        if not text:
            return
        out = self._reasoning if self._to == "reasoning" else self._answer
        if self._gap:
            out.append("\n\n")
            self._gap = False
        out.append(text)
        if not self._raw:
            self._said[self._to] = True


def split_reasoning(text: str, fmt: Optional[ReasoningFormat]) -> Split:
    """The reasoning and the answer of a whole output (what streaming it through a ReasoningSplitter gives)."""
    splitter = ReasoningSplitter(fmt)
    first, rest = splitter.feed(text), splitter.finish()
    return Split(first.reasoning + rest.reasoning, first.answer + rest.answer)
