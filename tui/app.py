"""The offspec chat app: a loading screen with real progress, then the chat.

`run_chat(load_options)` is what `offspec chat` calls; tests build `ChatApp(generator_factory=...)`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from textual.app import App
from textual.binding import Binding

import offspec
from offspec.errors import OffspecError
from offspec.progress import ProgressFn
from offspec.types import GeneratorLike
from offspec.util import paths

from .commands import ChatCommands
from .history import HistoryStore
from .loader import GeneratorFactory
from .screens import ChatScreen, LoadingScreen
from .session import ChatSession
from .settings import ChatSettings


class ChatApp(App[int]):
    """`generator_factory(progress)` builds the generator (off the UI thread); `data_dir` holds the history."""

    TITLE = "offspec chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("f1,question_mark", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, generator_factory: GeneratorFactory, *, data_dir: Optional[Path] = None,
                 generation: Optional[dict] = None):
        super().__init__()
        self.data_dir = Path(data_dir) if data_dir is not None else paths.data_dir()
        # OffspecError for an unusable history (read-only, ...), before any screen; a damaged one is set aside
        self.store = HistoryStore.open(self.data_dir)
        self.generation = dict(generation or {})  # `offspec chat --temperature ...`: this session's overrides
        ChatSettings().with_options(self.generation)  # a bad one is an OffspecError now, not inside the app
        self.generator_factory = generator_factory
        self.unsaved_replies = 0  # replies the history could not save by the time the app closed
        self.generator: Optional[GeneratorLike] = None
        self.chat_screen: Optional[ChatScreen] = None
        self.loading_screen: Optional[LoadingScreen] = None

    @property
    def load_error(self) -> Optional[str]:
        """The one-line reason loading failed (None when it did not)."""
        return self.loading_screen.error_line if self.loading_screen else None

    def on_mount(self) -> None:
        self.loading_screen = LoadingScreen(self.generator_factory, self.data_dir)
        self.push_screen(self.loading_screen, self._loaded)

    def _loaded(self, generator: Optional[GeneratorLike]) -> None:
        if generator is None:
            return
        self.generator = generator
        self.chat_screen = ChatScreen(generator, ChatSession(self.store, self.generation), self.data_dir)
        self.push_screen(self.chat_screen)

    def action_help(self) -> None:
        if self.chat_screen is not None and self.screen is self.chat_screen:
            self.chat_screen.action_help()

    async def action_quit(self) -> None:
        if self.chat_screen is not None:
            self.chat_screen.abandon_reply()
        self.exit(return_code=1 if self.load_error is not None else 0)  # ctrl+q on "Loading failed": a failure

    def on_unmount(self) -> None:
        if self.chat_screen is not None:
            self.chat_screen.abandon_reply()
            self.unsaved_replies = self.chat_screen.session.retry_unsaved()
        self.store.close()


def require_terminal() -> None:
    """The chat is a full-screen app: refuse to start without a terminal, in one line."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise OffspecError("offspec chat needs an interactive terminal (stdin and stdout must be a TTY); "
                           "for scripts and pipes use `offspec generate`")


def engine_factory(load_options: dict[str, Any]) -> GeneratorFactory:
    """A factory that calls `offspec.load(progress=..., **load_options)`."""
    options = dict(load_options)

    def factory(progress: ProgressFn) -> GeneratorLike:
        load = getattr(offspec, "load", None)
        if load is None:
            raise OffspecError("this offspec installation has no engine (offspec.load is missing); reinstall offspec")
        return load(progress=progress, **options)

    return factory


def run_chat(load_options: dict, *, data_dir: Optional[Path] = None, generation: Optional[dict] = None) -> int:
    """Run the chat on the models `offspec.load(**load_options)` gives; returns the exit code. `generation`:
    generation options (`temperature`, `max_new_tokens`, ...) in force for this session.

    Raises OffspecError (one line) without a terminal or with an unusable history database. If loading
    fails the app explains it on screen, and after it closes the reason is repeated on stderr (exit code 1).
    What the screen said about the history (a damaged file set aside, replies it could not save) is repeated
    on stderr too.
    """
    require_terminal()
    app = ChatApp(engine_factory(load_options), data_dir=data_dir, generation=generation)
    app.run()
    for line in exit_notes(app):
        sys.stderr.write(f"offspec chat: {line}\n")  # the screen that said it is gone
    return app.return_code or 0


def exit_notes(app: ChatApp) -> list[str]:
    """What to repeat on stderr once the app has closed."""
    notes = [app.load_error] if app.load_error else []
    if app.store.recovery is not None:
        notes.append(app.store.recovery.note())
    if app.unsaved_replies:
        notes.append(f"{app.unsaved_replies} reply(ies) could not be saved to the chat history in {app.data_dir} "
                     f"(see the message shown in the chat)")
    return notes
