"""The open chat: its messages, what the engine is sent each turn, and how replies are saved."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, TypeVar

from .history import Chat, HistoryStore, StoredMessage
from .history_base import CANCELLED, DONE, ERROR, STREAMING, HistoryError
from .settings import ChatSettings

SETTINGS_KEY = "chat_settings"
TITLE_LENGTH = 48
NEW_CHAT_TITLE = "New chat"
T = TypeVar("T")


def title_from(text: str) -> str:
    """A chat title from its first prompt: the first non-empty line, shortened."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), NEW_CHAT_TITLE)
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class ChatSession:
    """The chat being shown, backed by the history store. A new chat gets its row on its first message.

    A failing store (full disk, read-only or damaged file) never stops the chat: the conversation goes on in
    memory, `on_error` gets the one-line reason (once per run of failures), and replies whose save failed
    are saved again at the next turn and on quit (`retry_unsaved`)."""

    def __init__(self, store: HistoryStore, overrides: Optional[dict] = None,
                 on_error: Optional[Callable[[str], None]] = None):
        self.store = store
        self._early: list[str] = []  # errors reported before a UI attached (`attach`)
        self.on_error = on_error or self._early.append
        self.failing = False  # the last store operation failed (errors are reported when this turns True)
        # id -> (text, status, stats, reasoning) of the replies whose last save failed
        self.unsaved: dict[int, tuple[str, Optional[str], Optional[dict], Optional[str]]] = {}
        saved = self._try(lambda: store.get_setting(SETTINGS_KEY), None)
        self.settings = ChatSettings.from_json(saved).with_options(overrides or {})
        self.chat: Optional[Chat] = None
        self.messages: list[StoredMessage] = []
        self._system_prompt = self.settings.system_prompt

    def attach(self, on_error: Callable[[str], None]) -> None:
        """Report store errors to `on_error` from now on, starting with those that came before."""
        self.on_error = on_error
        for message in self._early:
            on_error(message)
        self._early.clear()

    def _try(self, operation: Callable[[], T], default: T) -> T:
        """Run a store operation; a HistoryError is reported (once per run of failures) and gives `default`."""
        try:
            result = operation()
        except HistoryError as error:
            if not self.failing:
                self.on_error(str(error))
            self.failing = True
            return default
        self.failing = False
        return result

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

    def list_chats(self) -> list[Chat]:
        return self._try(self.store.list_chats, [])

    def open(self, chat_id: int) -> bool:
        found = self._try(lambda: (self.store.get_chat(chat_id), self.store.messages(chat_id)), (None, []))
        if found[0] is None:
            return False
        self.chat, self.messages = found
        return True

    def open_latest(self) -> None:
        chats = self.list_chats()
        if not (chats and self.open(chats[0].id)):
            self.new_chat()

    def delete_current(self) -> None:
        if self.chat is not None:
            chat_id = self.chat.id
            self._try(lambda: self.store.delete_chat(chat_id), None)
        self.new_chat()

    # -- settings ----------------------------------------------------------------------------

    def update_settings(self, settings: ChatSettings) -> None:
        """New settings for every chat; the system prompt also becomes this chat's."""
        self.settings = settings.validate()
        self._try(lambda: self.store.set_setting(SETTINGS_KEY, settings.to_json()), None)
        self._system_prompt = settings.system_prompt
        if self.chat is not None and self.chat.system_prompt != settings.system_prompt:
            chat_id = self.chat.id
            self._try(lambda: self.store.update_chat(chat_id, system_prompt=settings.system_prompt), None)
            self.chat = replace(self.chat, system_prompt=settings.system_prompt)

    # -- a turn ------------------------------------------------------------------------------

    def start_turn(self, text: str) -> Optional[tuple[StoredMessage, StoredMessage]]:
        """Save the user message and an empty reply (status "streaming") in one transaction: (user, reply),
        or None when that fails (reported; nothing was saved, so the caller keeps the text and may retry)."""
        self.retry_unsaved()
        turn = self._try(lambda: self.store.start_turn(self.chat, title_from(text), self._system_prompt, text),
                         None)
        if turn is None:
            return None
        self.chat, user, reply = turn
        self.messages += [user, reply]
        return user, reply

    def add_user_message(self, text: str) -> StoredMessage:
        if self.chat is None:
            self.chat = self.store.create_chat(title_from(text), self._system_prompt)
        message = self.store.add_message(self.chat.id, "user", text)
        self.messages.append(message)
        return message

    def engine_messages(self) -> list[dict]:
        """The whole conversation in the engine's message format (partial replies included, empty ones not). A
        reply is its answer alone: chat templates drop the reasoning of earlier turns (Qwen3's), or refuse it in
        the content (gpt-oss's)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out += [{"role": m.role, "content": m.content} for m in self.messages if m.content or m.role == "user"]
        return out

    def begin_reply(self) -> StoredMessage:
        assert self.chat is not None, "a reply needs a user message first"
        message = self.store.add_message(self.chat.id, "assistant", "", status=STREAMING)
        self.messages.append(message)
        return message

    def _save(self, message_id: int, text: str, status: Optional[str] = None, stats: Optional[dict] = None,
              reasoning: Optional[str] = None) -> None:
        previous = self.unsaved.pop(message_id, None)
        if previous is not None:  # keep a final status that an earlier failed save carried
            status, stats = status or previous[1], stats if stats is not None else previous[2]
            reasoning = reasoning if reasoning is not None else previous[3]
        ok = self._try(lambda: (self.store.update_message(message_id, text, status=status, stats=stats,
                                                          reasoning=reasoning), True)[1], False)
        if not ok:
            self.unsaved[message_id] = (text, status, stats, reasoning)

    def retry_unsaved(self) -> int:
        """Save again the replies whose last save failed; returns how many are still unsaved."""
        for message_id, (text, status, stats, reasoning) in list(self.unsaved.items()):
            self._save(message_id, text, status, stats, reasoning)
            if message_id in self.unsaved:
                break  # still failing: no need to try the others now
        return len(self.unsaved)

    def save_partial(self, message_id: int, text: str, reasoning: str = "") -> None:
        """Save a reply while it grows (its answer and its reasoning so far), so a crash keeps what was shown."""
        self._save(message_id, text, reasoning=reasoning)

    def finish_reply(self, message_id: int, text: str, *, stop_reason: str, stats: Optional[dict] = None,
                     reasoning: str = "") -> str:
        """Save the final answer and reasoning of a reply; returns its status (done, cancelled or error)."""
        status = {"cancelled": CANCELLED, "error": ERROR}.get(stop_reason, DONE)
        stats = dict(stats or {}, stop_reason=stop_reason)
        self._save(message_id, text, status, stats, reasoning)
        self.messages = [replace(m, content=text, status=status, stats=stats, reasoning=reasoning)
                         if m.id == message_id else m for m in self.messages]
        return status

    def discard_reply(self, message_id: int) -> None:
        """Forget a reply that produced nothing (e.g. the engine failed at once)."""
        self.unsaved.pop(message_id, None)
        self._try(lambda: self.store.delete_message(message_id), None)
        self.messages = [m for m in self.messages if m.id != message_id]

    def message(self, message_id: int) -> Optional[StoredMessage]:
        return next((m for m in self.messages if m.id == message_id), None)

    def last_reply(self) -> Optional[StoredMessage]:
        return next((m for m in reversed(self.messages) if m.role == "assistant" and m.content), None)
