"""The conversation: message bubbles in a scroll view that follows a reply only while the user is at the bottom."""

from __future__ import annotations

from typing import Iterable, Optional

from textual.containers import VerticalScroll
from textual.widgets import Static

from ..history import DONE, StoredMessage
from .message import MessageBubble

EMPTY_HINT = "Type a message and press Enter. F1 shows the keys, ctrl+p the commands."


def message_meta(message: StoredMessage) -> str:
    """The header figures of a stored message: speed and, if it did not finish normally, its status."""
    parts = []
    stats = message.stats or {}
    if message.role == "assistant" and stats.get("tokens"):
        parts.append(f"{stats['tokens']} tok")
        if stats.get("tokens_per_second"):
            parts.append(f"{stats['tokens_per_second']:.1f} tok/s")
        if stats.get("tokens_per_pass"):
            parts.append(f"{stats['tokens_per_pass']:.2f} tok/pass")
    if message.status != DONE:
        parts.append(message.status)
    return " · ".join(parts)


class ChatView(VerticalScroll, can_focus=False):
    """Anchored to the bottom: new text keeps it scrolled down until the user scrolls up, and
    scrolling back to the bottom follows again (Textual's anchor)."""

    DEFAULT_CSS = """
    ChatView { height: 1fr; padding-top: 1; }
    ChatView > .empty-hint { color: $text-muted; margin: 1 2; }
    """

    def on_mount(self) -> None:
        self.anchor()

    async def show(self, messages: Iterable[StoredMessage]) -> None:
        """Replace the view with these messages."""
        await self.remove_children()
        bubbles = [MessageBubble(m.role, m.content, reasoning=m.reasoning, message_id=m.id, meta=message_meta(m))
                   for m in messages]
        if bubbles:
            await self.mount_all(bubbles)
        else:
            await self.mount(Static(EMPTY_HINT, classes="empty-hint"))
        self.anchor()

    async def add(self, role: str, content: str = "", *, message_id: Optional[int] = None,
                  meta: str = "") -> MessageBubble:
        for hint in self.query(".empty-hint"):
            await hint.remove()
        bubble = MessageBubble(role, content, message_id=message_id, meta=meta)
        await self.mount(bubble)
        return bubble

    def follow(self) -> None:
        """Jump to the bottom and follow again (after the user sends a message)."""
        self.anchor()

    def bubble(self, message_id: int) -> Optional[MessageBubble]:
        return next((b for b in self.query(MessageBubble) if b.message_id == message_id), None)

    def bubbles(self) -> list[MessageBubble]:
        return list(self.query(MessageBubble))
