"""Command palette entries (ctrl+p) for the chat's actions, and one per saved chat to open it."""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from textual.command import DiscoveryHit, Hit, Hits, Provider

ACTIONS = (  # (name, help, ChatScreen action)
    ("New chat", "Start a new conversation (ctrl+n)", "new_chat"),
    ("Chats", "Show the chat list (ctrl+o)", "chats"),
    ("Settings", "Temperature, top-p, tree budget, max tokens, system prompt (F2)", "settings"),
    ("Toggle tree panel", "Show or hide the last speculation tree (ctrl+t)", "toggle_tree"),
    ("Copy reply", "Copy the last reply to the clipboard (ctrl+y)", "copy_reply"),
    ("Export chat to Markdown", "Write this chat to a .md file (ctrl+s)", "export"),
    ("Stop generation", "Stop the reply being generated (Esc)", "stop"),
    ("Help", "Keys and what the status line shows (F1)", "help"),
)


class ChatCommands(Provider):
    def _screen(self):
        return getattr(self.app, "chat_screen", None)

    def _commands(self) -> list[tuple[str, str, Callable]]:
        screen = self._screen()
        if screen is None:
            return []
        commands = [(name, help_text, partial(screen.run_action, action)) for name, help_text, action in ACTIONS]
        commands.append(("Delete this chat", "Delete the open chat and its messages (asks first)", screen.delete_chat))
        current: Optional[int] = screen.session.chat.id if screen.session.chat else None
        for chat in screen.session.list_chats():
            if chat.id != current:
                commands.append((f"Open chat: {chat.title}", "Switch to this chat", partial(screen.open_chat, chat.id)))
        return commands

    async def discover(self) -> Hits:
        for name, help_text, command in self._commands():
            yield DiscoveryHit(name, command, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, command in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), command, help=help_text)
