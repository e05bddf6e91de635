"""The chat screen: conversation, prompt, chat list, tree panel and status line; replies stream from a thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, OptionList

from offspec.types import GeneratorLike

from ..errors import describe, is_user_error, write_error_log
from ..export import export_chat
from ..history import StoredMessage
from ..session import ChatSession
from ..settings import ChatSettings, format_budget
from ..stats import ReplyMeter, ResourceSampler, speed_line
from ..streaming import ReplyChunk, ReplyDone, ReplyFailed, start_reply
from ..widgets import ChatList, ChatView, MessageBubble, StatusLine, TreePanel
from ..widgets.chat_view import message_meta
from .confirm import ConfirmScreen
from .help import HelpScreen
from .settings import SettingsScreen

SAVE_SECONDS = 1.0  # a growing reply is saved at least this often (crash safety)
RESOURCE_SECONDS = 2.0  # memory figures refresh
WIDE_SCREEN = 110  # columns from which the chat list is shown at start
EXTRA_KEYS = (
    ("enter", "Send the message"),
    ("c", "Copy the focused message (Tab / click to focus one; a reply's answer, without its reasoning)"),
    ("enter / click on ▶ Reasoning", "Unfold or fold a reply's reasoning (folded and dimmed above its answer)"),
    ("tab / shift+tab", "Move focus"),
    ("pageup / pagedown", "Scroll the conversation"),
    ("f1 / ?", "This help"),
    ("ctrl+p", "Command palette: every action, and open any chat by name"),
    ("ctrl+q", "Quit (a reply being generated is stopped and saved)"),
)


@dataclass
class ActiveReply:
    """The reply being generated."""

    id: int
    bubble: MessageBubble
    cancel: threading.Event = field(default_factory=threading.Event)
    meter: ReplyMeter = field(default_factory=ReplyMeter)
    last_saved: float = field(default_factory=time.monotonic)


class ChatScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply; what was generated is kept"),
        Binding("ctrl+n", "new_chat", "New chat", tooltip="Start a new chat"),
        Binding("ctrl+o", "chats", "Chats", tooltip="Show and focus the chat list (Enter opens one); again hides it"),
        Binding("f2", "settings", "Settings", tooltip="Temperature, top-p, tree budget, max tokens, system prompt"),
        Binding("ctrl+t", "toggle_tree", "Tree", tooltip="Show or hide the last speculation tree"),
        Binding("ctrl+y", "copy_reply", "Copy reply", tooltip="Copy the last reply to the clipboard (OSC 52)"),
        Binding("ctrl+s", "export", "Export", tooltip="Export this chat to Markdown (the path is shown)"),
        Binding("pageup", "scroll_view(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_view(1)", "Scroll down", show=False),
    ]

    DEFAULT_CSS = """
    ChatScreen #body { height: 1fr; }
    ChatScreen #main { width: 1fr; }
    ChatScreen #prompt { margin: 0 1; }
    """

    def __init__(self, generator: GeneratorLike, session: ChatSession, data_dir: Path):
        super().__init__()
        self.generator, self.session, self.data_dir = generator, session, data_dir
        self.reply: Optional[ActiveReply] = None
        self.last_meter: Optional[ReplyMeter] = None
        self.resources = ResourceSampler(generator.info.device)

    # -- layout ------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield ChatList(id="chats")
            with Vertical(id="main"):
                yield ChatView(id="conversation")
                yield Input(placeholder="Message (Enter sends · F1 help · ctrl+p commands)", id="prompt")
            yield TreePanel(getattr(self.generator, "decode", None), id="tree")
        yield StatusLine(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self.session.attach(lambda line: self.notify(line, title="Chat history", severity="error", timeout=20,
                                                     markup=False))
        recovery = getattr(self.session.store, "recovery", None)
        if recovery is not None:  # the history was damaged: say where the backup is, for long enough to read it
            self.notify(recovery.note(), title="Chat history recovered", severity="warning", timeout=60,
                        markup=False)
        await self.show_chat()
        if self.session.list_chats() and self.app.size.width >= WIDE_SCREEN:
            self.query_one(ChatList).add_class("visible")  # saved chats one keypress away
        self.refresh_chat_list()
        self.refresh_status(system=True)
        self.set_interval(RESOURCE_SECONDS, lambda: self.refresh_status(system=True))
        self.query_one("#prompt", Input).focus()

    async def show_chat(self) -> None:
        self.app.sub_title = self.session.title
        await self.query_one(ChatView).show(self.session.messages)

    def refresh_chat_list(self) -> None:
        chat = self.session.chat
        self.query_one(ChatList).set_chats(self.session.list_chats(), chat.id if chat else None)

    def refresh_status(self, system: bool = False) -> None:
        meter = self.reply.meter if self.reply else self.last_meter
        status = self.query_one(StatusLine)
        speed = speed_line(meter, self.generator.info, self.session.settings.budget)
        status.show(speed, self.resources.line(self.generator.info) if system else None)

    def help_keys(self) -> list[tuple[str, str]]:
        keys = [(b.key, b.tooltip or b.description) for b in self.BINDINGS if isinstance(b, Binding) and b.show]
        return keys + list(EXTRA_KEYS)

    def check_action(self, action: str, parameters: tuple) -> Optional[bool]:
        if action == "stop":
            return True if self.reply is not None else None  # shown dimmed while idle
        return True

    # -- sending and streaming ---------------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "prompt":
            return
        text = event.value.strip()
        if not text:
            return
        if self.reply is not None:
            self.notify("A reply is being generated: wait for it, or press Esc to stop it.", severity="warning")
            return
        event.input.clear()
        if not await self.send(text):
            event.input.value = text  # it could not be saved: keep it for another try

    async def send(self, text: str) -> bool:
        """Send `text` as the next user message and start streaming the reply; False (and nothing sent) when
        it cannot be saved (the session reported why)."""
        turn = self.session.start_turn(text)
        if turn is None:
            return False
        user, stored = turn
        view = self.query_one(ChatView)
        await view.add("user", text, message_id=user.id)
        messages = self.session.engine_messages()
        bubble = await view.add("assistant", "", message_id=stored.id, meta="generating…")
        view.follow()
        self.reply = ActiveReply(stored.id, bubble)
        self.app.sub_title = self.session.title
        self.refresh_chat_list()
        self.refresh_bindings()
        self.refresh_status()
        start_reply(self.generator, messages, self.session.settings.generation_kwargs(), self.reply.cancel,
                    stored.id, self.post_message)
        return True

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        reply = self.reply
        if reply is None or message.reply_id != reply.id:
            return
        reply.meter.add(message.token_count, message.passes)
        await reply.bubble.append(message.text, message.reasoning)
        trees = [p.tree for p in message.passes if p.tree is not None]
        if trees:
            self.query_one(TreePanel).show_tree(trees[-1])
        self.refresh_status()
        if time.monotonic() - reply.last_saved >= SAVE_SECONDS:
            self.session.save_partial(reply.id, reply.bubble.content, reply.bubble.reasoning)
            reply.last_saved = time.monotonic()

    async def on_reply_done(self, message: ReplyDone) -> None:
        reply = self.reply
        if reply is None or message.reply_id != reply.id:
            return
        result = message.result
        reply.meter.finish(result)
        trees = [p.tree for p in result.passes if p.tree is not None]
        if trees:
            self.query_one(TreePanel).show_tree(trees[-1])
        self.session.finish_reply(reply.id, message.answer, stop_reason=result.stop_reason,
                                  stats=reply.meter.summary(), reasoning=message.reasoning)
        self._end_reply(reply)
        await reply.bubble.finish(message.answer, self._meta(reply.id), message.reasoning)

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        reply = self.reply
        if reply is None or message.reply_id != reply.id:
            return
        error = message.error
        log = None if is_user_error(error) else write_error_log(self.data_dir, error, "generating a reply")
        where = f" (traceback in {log})" if log else ""
        self.notify(f"Generation failed: {describe(error)}{where}", severity="error", timeout=15, markup=False)
        text, reasoning = reply.bubble.content, reply.bubble.reasoning
        self._end_reply(reply)
        if text or reasoning:
            self.session.finish_reply(reply.id, text, stop_reason="error", stats=reply.meter.summary(),
                                      reasoning=reasoning)
            await reply.bubble.finish(text, self._meta(reply.id))
        else:
            self.session.discard_reply(reply.id)
            await reply.bubble.remove()

    def _end_reply(self, reply: ActiveReply) -> None:
        reply.meter.end("error")  # a failed reply (no result) stops its clock; after a result it has stopped
        self.reply, self.last_meter = None, reply.meter
        self.refresh_bindings()
        self.refresh_status()

    def _meta(self, message_id: int) -> str:
        stored: Optional[StoredMessage] = self.session.message(message_id)
        return message_meta(stored) if stored else ""

    def action_stop(self) -> None:
        """Esc: ask the engine to stop after the current pass; the text so far is saved now."""
        if self.reply is None:
            return
        self.reply.cancel.set()
        self.reply.bubble.set_meta("stopping…")
        self.session.save_partial(self.reply.id, self.reply.bubble.content, self.reply.bubble.reasoning)

    def abandon_reply(self) -> None:
        """On quit: stop the engine and save the reply as it is, marked cancelled."""
        reply = self.reply
        if reply is None:
            return
        reply.cancel.set()
        self.session.finish_reply(reply.id, reply.bubble.content, stop_reason="cancelled",
                                  stats=reply.meter.summary(), reasoning=reply.bubble.reasoning)
        self.reply = None

    # -- chats -------------------------------------------------------------------------------

    def _busy(self) -> bool:
        if self.reply is not None:
            self.notify("A reply is being generated: press Esc to stop it first.", severity="warning")
        return self.reply is not None

    async def action_new_chat(self) -> None:
        if self._busy():
            return
        self.session.new_chat()
        await self.show_chat()
        self.refresh_chat_list()
        self.query_one("#prompt", Input).focus()

    async def open_chat(self, chat_id: int) -> None:
        if self._busy():
            return
        if not self.session.open(chat_id):
            self.notify("That chat no longer exists.", severity="warning")
            return
        await self.show_chat()
        self.refresh_chat_list()
        self.query_one("#prompt", Input).focus()

    async def on_chat_list_chosen(self, message: ChatList.Chosen) -> None:
        await self.open_chat(message.chat_id)

    def action_chats(self) -> None:
        """Show the chat list and focus it; again (while it has focus) hides it."""
        chats = self.query_one(ChatList)
        options = chats.query_one(OptionList)
        if chats.is_shown and options.has_focus:
            chats.remove_class("visible")
            self.query_one("#prompt", Input).focus()
            return
        self.refresh_chat_list()
        chats.add_class("visible")
        options.focus()

    def delete_chat(self) -> None:
        if self._busy() or self.session.chat is None:
            return
        title = self.session.title

        async def answered(yes: Optional[bool]) -> None:
            if yes:
                self.session.delete_current()
                await self.show_chat()
                self.refresh_chat_list()
                self.notify(f"Deleted chat “{title}”.", markup=False)

        self.app.push_screen(ConfirmScreen(f"Delete the chat “{title}” and all its messages?"), answered)

    # -- other actions -----------------------------------------------------------------------

    def action_settings(self) -> None:
        def apply(settings: Optional[ChatSettings]) -> None:
            if settings is None:
                return
            self.session.update_settings(settings)
            self.refresh_status()
            self.notify(f"Settings saved: temperature {settings.temperature:g} · top-p {settings.top_p:g} · "
                        f"budget {format_budget(settings.budget)} · drafter {settings.drafter or 'auto'} · "
                        f"max tokens {settings.max_new_tokens}")

        self.app.push_screen(SettingsScreen(self.session.settings, self.session.system_prompt), apply)

    def action_toggle_tree(self) -> None:
        self.query_one(TreePanel).toggle()

    def action_copy_reply(self) -> None:
        if self.reply is not None:
            text = self.reply.bubble.content
        else:
            last = self.session.last_reply()
            text = last.content if last else ""
        if not text:
            self.notify("There is no reply to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        self.notify(f"Copied the reply ({len(text)} characters) to the clipboard.")

    def action_export(self) -> None:
        if not self.session.messages:
            self.notify("Nothing to export: this chat has no messages yet.", severity="warning")
            return
        chat = self.session.chat
        try:
            path = export_chat(self.data_dir, chat.id if chat else None, self.session.title,
                               self.session.system_prompt, self.session.messages, self.generator.info)
        except OSError as error:
            self.notify(f"Export failed: {describe(error)}", severity="error", markup=False)
            return
        self.notify(f"Exported to {path}", title="Chat exported", timeout=10, markup=False)

    def action_scroll_view(self, direction: int) -> None:
        view = self.query_one(ChatView)
        view.scroll_page_down() if direction > 0 else view.scroll_page_up()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.help_keys()))
