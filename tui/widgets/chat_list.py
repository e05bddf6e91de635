"""The sidebar with every saved chat; choosing one opens it."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from ..history import Chat


def _when(timestamp: float) -> str:
    fmt = "%H:%M" if time.localtime(timestamp)[:3] == time.localtime()[:3] else "%b %d"
    return time.strftime(fmt, time.localtime(timestamp))


class ChatList(Vertical):
    DEFAULT_CSS = """
    ChatList { width: 34; border-right: solid $primary 50%; display: none; }
    ChatList.visible { display: block; }
    ChatList > .title { text-style: bold; color: $accent; padding: 0 1; }
    ChatList > OptionList { height: 1fr; border: none; }
    """

    class Chosen(Message):
        def __init__(self, chat_id: int):
            super().__init__()
            self.chat_id = chat_id

    def compose(self) -> ComposeResult:
        yield Static("Chats (Enter opens)", classes="title")
        yield OptionList(id="chat-options")

    @property
    def is_shown(self) -> bool:
        return self.has_class("visible")

    def set_chats(self, chats: Sequence[Chat], current: Optional[int]) -> None:
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options([Option(Text.assemble(c.title, (f"  {_when(c.updated_at)}", "dim")), id=str(c.id))
                             for c in chats])
        if not chats:
            return
        ids = [c.id for c in chats]
        options.highlighted = ids.index(current) if current in ids else 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.Chosen(int(event.option.id)))
