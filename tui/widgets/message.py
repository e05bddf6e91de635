"""One message of the conversation: a header line and the text (a reply renders as streaming Markdown, below its
reasoning, folded, where the model wrote some)."""

from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from .reasoning import ReasoningFold

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}


class MessageBubble(Vertical, can_focus=True):
    """Focus it (Tab or click) and press c to copy its text (a reply's answer: its reasoning is not copied)."""

    BINDINGS = [Binding("c", "copy", "Copy message")]

    DEFAULT_CSS = """
    MessageBubble { height: auto; margin: 0 1 1 1; padding: 0 1; border-left: thick $primary 40%; }
    MessageBubble.user { border-left: thick $accent; background: $boost; }
    MessageBubble:focus { border-left: thick $warning; }
    MessageBubble > .header { color: $text-muted; text-style: bold; }
    MessageBubble > .body { height: auto; }
    MessageBubble > Markdown { margin: 0; padding: 0; }
    """

    def __init__(self, role: str, content: str = "", *, reasoning: str = "", message_id: Optional[int] = None,
                 meta: str = ""):
        super().__init__(classes=role)
        self.role, self.content, self.message_id, self._meta = role, content, message_id, meta
        self.reasoning = reasoning  # a reply's reasoning, apart from `content` (its answer)
        self._stream: Optional[MarkdownStream] = None

    def compose(self) -> ComposeResult:
        yield Static(self._header_text(), classes="header")
        if self.role == "assistant":
            yield ReasoningFold(self.reasoning)
            yield Markdown(self.content, classes="body")
        else:
            yield Static(Text(self.content), classes="body")

    def _header_text(self) -> Text:
        text = Text(ROLE_NAMES.get(self.role, self.role))
        if self._meta:
            text.append(f" · {self._meta}", style="not bold")
        return text

    def set_meta(self, meta: str) -> None:
        self._meta = meta
        if self.is_mounted:
            self.query_one(".header", Static).update(self._header_text())

    async def append(self, text: str, reasoning: str = "") -> None:
        """Add streamed answer text and reasoning (replies only); rendering catches up in the background."""
        fold = self.query_one(ReasoningFold)
        self.reasoning += reasoning
        fold.append(reasoning)
        if not text:
            return
        if fold.streaming:
            fold.done()  # the answer began: the reasoning is whole
        self.content += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)

    async def finish(self, text: str, meta: str, reasoning: Optional[str] = None) -> None:
        """The reply is complete: show exactly `text` (the engine's final answer), `reasoning` (when given) and its
        figures."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if reasoning is not None:
            self.reasoning = reasoning
        self.query_one(ReasoningFold).done(self.reasoning)
        if text != self.content:
            self.content = text
            await self.query_one(Markdown).update(text)
        self.set_meta(meta)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify(f"Copied the message ({len(self.content)} characters) to the clipboard.")
