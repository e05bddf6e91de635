"""A chat reply on its way to a client: the model's text split into its reasoning (`reasoning_content`) and its answer
(`content`) by offspec.util.reasoning, then, where the request offers tools, the calls held back from the content.

The split comes first, so that a tool call's markers written while the model reasons are never read as a call; a
request with `reasoning_format: "none"` (or a model without reasoning markers) has no split: its text is the content,
as the model wrote it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from offspec.types import TextDelta
from offspec.util.reasoning import ReasoningFormat, ReasoningSplitter, Split, split_reasoning

from .tools import Parsed, ToolCall, ToolFormat, ToolStream


class IdText:
    """Token ids in, text out as it becomes final: the ids so far decoded whole each time (`decode`, special tokens
    kept), an unfinished character held back."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text given out

    def feed(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        text = self.decode(self.ids)
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":  # the first bytes of a character
            end -= 1
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def finish(self) -> str:
        text = self.decode(self.ids)
        piece, self.sent = text[self.sent :], len(text)
        return piece


class ReplyStream:
    """One streamed reply's deltas. `reasoning`: the model's format (None: no split); `tools` and `decode` (token ids
    to text, special tokens kept) where the request offers tools: their markers may be special tokens, which the
    stream's own text leaves out."""

    def __init__(self, reasoning: Optional[ReasoningFormat], tools: Optional[ToolStream] = None,
                 decode: Optional[Callable[[Sequence[int]], str]] = None):
        if tools is not None and decode is None:
            raise ValueError("a reply with tools is read from its token ids: give `decode`")
        self.splitter = ReasoningSplitter(reasoning)
        self.tools = tools
        self.text = IdText(decode) if tools is not None else None

    def feed(self, event: TextDelta) -> Split:
        """The reasoning and the content of one pass that can be sent now."""
        text = self.text.feed(event.token_ids) if self.text is not None else event.text
        split = self.splitter.feed(text)
        return Split(split.reasoning, self.tools.feed(split.answer)) if self.tools is not None else split

    def finish(self) -> tuple[Split, tuple[ToolCall, ...]]:
        """What is left once the reply is whole, and its tool calls."""
        first = self.splitter.feed(self.text.finish()) if self.text is not None else Split()
        rest = self.splitter.finish()
        reasoning, answer = first.reasoning + rest.reasoning, first.answer + rest.answer
        if self.tools is None:
            return Split(reasoning, answer), ()
        content = self.tools.feed(answer)
        left, calls = self.tools.finish()
        return Split(reasoning, content + left), calls


def whole_reply(text: str, reasoning: Optional[ReasoningFormat], tools: Optional[ToolFormat] = None,
                names: Sequence[str] = ()) -> tuple[Split, Optional[Parsed]]:
    """A non-streamed reply: its reasoning and content, and its tool calls where `tools` is its format and it holds
    well-formed ones (`text`: decoded with special tokens kept, where tools are offered)."""
    split = split_reasoning(text, reasoning)
    return split, (tools.parse(split.answer, names) if tools is not None else None)
