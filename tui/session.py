"""The open chat: its messages, what the engine is sent each turn, and how replies are saved."""

from __future__ import annotations

from typing import Optional

from .history import CANCELLED, DONE, ERROR, STREAMING, Chat, HistoryStore, StoredMessage
from .settings import ChatSettings

SETTINGS_KEY = "chat_settings"
TITLE_LENGTH = 48
NEW_CHAT_TITLE = "New chat"


def title_from(text: str) -> str:
    """A chat title from its first prompt: the first non-empty line, shortened."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), NEW_CHAT_TITLE)
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class ChatSession:
    """The chat being shown, backed by the history store. A new chat gets its row on its first message."""

    def __init__(self, store: HistoryStore):
        self.store = store
        self.settings = ChatSettings.from_json(store.get_setting(SETTINGS_KEY))
        self.chat: Optional[Chat] = None
        self.messages: list[StoredMessage] = []
        self._system_prompt = self.settings.system_prompt

    # -- which chat --------------------------------------------------------------------------

    @property
    def title(self) -> str:
        return self.chat.title if self.chat else NEW_CHAT_TITLE

    @property
    def system_prompt(self) -> str:
        return self.chat.system_prompt if self.chat else self._system_prompt

    def new_chat(self) -> None:
        self.chat, self.messages = None, []
        self._system_prompt = self.settings.system_prompt

    def open(self, chat_id: int) -> bool:
        chat = self.store.get_chat(chat_id)
        if chat is None:
            return False
        self.chat, self.messages = chat, self.store.messages(chat_id)
        return True

    def open_latest(self) -> None:
        chats = self.store.list_chats()
        if chats:
            self.open(chats[0].id)
        else:
            self.new_chat()

    def delete_current(self) -> None:
        if self.chat is not None:
            self.store.delete_chat(self.chat.id)
        self.new_chat()

    # -- settings ----------------------------------------------------------------------------

    def update_settings(self, settings: ChatSettings) -> None:
        """New settings for every chat; the system prompt also becomes this chat's."""
        self.settings = settings.validate()
        self.store.set_setting(SETTINGS_KEY, settings.to_json())
        self._system_prompt = settings.system_prompt
        if self.chat is not None and self.chat.system_prompt != settings.system_prompt:
            self.store.update_chat(self.chat.id, system_prompt=settings.system_prompt)
            self.chat = self.store.get_chat(self.chat.id)

    # -- a turn ------------------------------------------------------------------------------

    def add_user_message(self, text: str) -> StoredMessage:
        if self.chat is None:
            self.chat = self.store.create_chat(title_from(text), self._system_prompt)
        message = self.store.add_message(self.chat.id, "user", text)
        self.messages.append(message)
        return message

    def engine_messages(self) -> list[dict]:
        """The whole conversation in the engine's message format (partial replies included, empty ones not)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out += [{"role": m.role, "content": m.content} for m in self.messages if m.content or m.role == "user"]
        return out

    def begin_reply(self) -> StoredMessage:
        assert self.chat is not None, "a reply needs a user message first"
        message = self.store.add_message(self.chat.id, "assistant", "", status=STREAMING)
        self.messages.append(message)
        return message

    def save_partial(self, message_id: int, text: str) -> None:
        """Save a reply while it grows, so a crash keeps what was shown."""
        self.store.update_message(message_id, text)

    def finish_reply(self, message_id: int, text: str, *, stop_reason: str, stats: Optional[dict] = None) -> str:
        """Save the final text of a reply; returns its status (done, cancelled or error)."""
        status = {"cancelled": CANCELLED, "error": ERROR}.get(stop_reason, DONE)
        stats = dict(stats or {}, stop_reason=stop_reason)
        self.store.update_message(message_id, text, status=status, stats=stats)
        self.messages = [
            StoredMessage(m.id, m.chat_id, m.role, text, status, stats, m.created_at) if m.id == message_id else m
            for m in self.messages
        ]
        return status

    def discard_reply(self, message_id: int) -> None:
        """Forget a reply that produced nothing (e.g. the engine failed at once)."""
        self.store.delete_message(message_id)
        self.messages = [m for m in self.messages if m.id != message_id]

    def message(self, message_id: int) -> Optional[StoredMessage]:
        return next((m for m in self.messages if m.id == message_id), None)

    def last_reply(self) -> Optional[StoredMessage]:
        return next((m for m in reversed(self.messages) if m.role == "assistant" and m.content), None)
