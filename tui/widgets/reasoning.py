"""A reply's reasoning (Qwen3's `<think>` block, gpt-oss's analysis channel): folded and dimmed above the answer, so
that it never reads as the answer. Enter on its title (or a click) unfolds it; it is hidden while a reply has none."""

from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.widgets import Collapsible, Static

THINKING, REASONING = "Thinking…", "Reasoning"


def reasoning_title(text: str, streaming: bool) -> str:
    """"Thinking…" while the reasoning grows, then "Reasoning · N words"."""
    if streaming:
        return THINKING
    words = len(text.split())
    return f"{REASONING} · {words} word{'s' if words != 1 else ''}"


class ReasoningFold(Collapsible):
    """The reasoning's text (plain, never Markdown: it is the model's notes) under a one-line title, folded."""

    DEFAULT_CSS = """
    ReasoningFold { background: transparent; border-top: none; padding: 0; margin: 0; }
    ReasoningFold.empty { display: none; }
    ReasoningFold > Contents { padding: 0 0 0 2; }
    ReasoningFold CollapsibleTitle { padding: 0; color: $text-muted; }
    ReasoningFold .reasoning-text { color: $text-muted; text-style: italic; }
    """

    def __init__(self, text: str = "", *, streaming: bool = False):
        self._body = Static(Text(text), classes="reasoning-text")
        super().__init__(self._body, title=reasoning_title(text, streaming), collapsed=True,
                         classes="" if text else "empty")
        self.text, self.streaming = text, streaming

    def _show(self) -> None:
        self.set_class(not self.text, "empty")
        self.title = reasoning_title(self.text, self.streaming)
        self._body.update(Text(self.text))

    def append(self, text: str) -> None:
        """More reasoning streamed in."""
        if text:
            self.text += text
            self.streaming = True
            self._show()

    def done(self, text: Optional[str] = None) -> None:
        """The reasoning is complete (the answer began, or the reply ended): exactly `text` when given."""
        if text is not None:
            self.text = text
        self.streaming = False
        self._show()
