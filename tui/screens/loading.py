"""The loading screen: one row per step (assemble, verify, convert, load, warmup) with real progress."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from offspec.progress import ProgressEvent
from offspec.types import GeneratorLike

from ..errors import advice, describe, is_user_error, write_error_log
from ..loader import GeneratorFactory, LoadDone, LoadFailed, LoadProgress, start_load

STEP_NAMES = {"download": "Download", "assemble": "Assemble", "verify": "Verify", "convert": "Convert", "load": "Load",
              "warmup": "Warm up"}


def _amount(event: ProgressEvent) -> str:
    if event.total:
        return f"{event.done:,.0f} / {event.total:,.0f}"
    return f"{event.done:,.0f}" if event.done else ""


class StepRow(Horizontal):
    """One step: a mark (… running, ✓ done, ✗ failed), its name, its message and progress.

    The row keeps its state and draws it when mounted, so events may arrive before it is composed.
    """

    DEFAULT_CSS = """
    StepRow { height: 1; }
    StepRow > .mark { width: 3; }
    StepRow > .name { width: 10; text-style: bold; }
    StepRow > .message { width: 1fr; }
    StepRow > ProgressBar { width: 36; }
    StepRow > .amount { width: 24; color: $text-muted; }
    StepRow.done > .mark { color: $success; }
    StepRow.failed > .mark { color: $error; }
    """

    MARKS = {"running": "…", "done": "✓", "failed": "✗"}

    def __init__(self, step: str):
        super().__init__(classes="running")
        self.step = step
        self.state = "running"
        self.event: Optional[ProgressEvent] = None
        self._composed = False  # is_mounted only turns True after on_mount returns

    @property
    def finished(self) -> bool:
        return self.state != "running"

    def compose(self) -> ComposeResult:
        yield Static(self.MARKS["running"], classes="mark")
        yield Static(STEP_NAMES.get(self.step, self.step), classes="name")
        yield Static("", classes="message")
        yield ProgressBar(total=None, show_eta=False)
        yield Static("", classes="amount")

    def on_mount(self) -> None:
        self._composed = True
        self._draw()

    def show(self, event: ProgressEvent) -> None:
        self.event = event
        if event.finished:
            self.state = "done"
        self._draw()

    def mark_done(self) -> None:
        self.state = "done"
        self._draw()

    def mark_failed(self) -> None:
        self.state = "failed"
        self._draw()

    def _draw(self) -> None:
        if not self._composed:
            return
        self.set_classes(self.state)
        self.query_one(".mark", Static).update(self.MARKS[self.state])
        bar = self.query_one(ProgressBar)
        event = self.event
        if event is not None:
            self.query_one(".message", Static).update(Text(event.message))
            self.query_one(".amount", Static).update(_amount(event))
            if event.total:
                bar.update(total=event.total, progress=min(event.done, event.total))
        if self.state == "done" and bar.total:
            bar.update(progress=bar.total)
        # An unknown total shows an indeterminate bar while running, nothing once finished.
        bar.display = self.state != "failed" and (bar.total is not None or self.state == "running")


class LoadingScreen(Screen[GeneratorLike]):
    """Dismissed with the generator once loaded; on failure it explains, and any of q/Esc/Enter exits (code 1)."""

    BINDINGS = [Binding("q,escape,enter", "leave", "Quit", show=False)]

    DEFAULT_CSS = """
    LoadingScreen { align: center middle; }
    LoadingScreen > Vertical { width: 100; height: auto; border: round $primary; padding: 1 2; }
    LoadingScreen .title { text-style: bold; color: $accent; margin-bottom: 1; }
    LoadingScreen #steps { height: auto; }
    LoadingScreen #failure { display: none; margin-top: 1; height: auto; }
    LoadingScreen #failure.shown { display: block; }
    LoadingScreen #failure .what { color: $error; text-style: bold; }
    """

    def __init__(self, factory: GeneratorFactory, data_dir: Path):
        super().__init__()
        self.factory, self.data_dir = factory, data_dir
        self.error: Optional[BaseException] = None
        self.error_line: Optional[str] = None

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("offspec chat — loading the models", classes="title")
            yield Vertical(id="steps")
            with Vertical(id="failure"):
                yield Static("", classes="what")
                yield Static("", classes="todo")
                yield Static("Press q, Esc or Enter to quit.", classes="hint")
        yield Footer()

    def on_mount(self) -> None:
        start_load(self.factory, self.post_message)

    def _row(self, step: str) -> StepRow:
        for row in self.query(StepRow):
            if row.step == step:
                return row
        row = StepRow(step)
        self.query_one("#steps").mount(row)
        return row

    def on_load_progress(self, message: LoadProgress) -> None:
        self._row(message.event.step).show(message.event)

    def on_load_done(self, message: LoadDone) -> None:
        for row in self.query(StepRow):
            if not row.finished:
                row.mark_done()
        self.dismiss(message.generator)

    def on_load_failed(self, message: LoadFailed) -> None:
        error = message.error
        self.error = error
        log = None if is_user_error(error) else write_error_log(self.data_dir, error, "loading the models")
        running = [row for row in self.query(StepRow) if not row.finished]
        step = running[-1].step if running else None
        for row in running:
            row.mark_failed()
        where = f" during '{STEP_NAMES.get(step, step)}'" if step else ""
        self.error_line = f"Loading failed{where}: {describe(error)}"
        self.query_one("#failure .what", Static).update(Text(self.error_line))
        self.query_one("#failure .todo", Static).update(Text(advice(error, log)))
        self.query_one("#failure").add_class("shown")

    def action_leave(self) -> None:
        if self.error is not None:
            self.app.exit(return_code=1)
