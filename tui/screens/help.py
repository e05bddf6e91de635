"""The help screen: every key and what the status line means."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

STATUS_HELP = (
    "Status line: tokens per second of the reply · tokens per target pass (how many tokens each verification "
    "of the speculation tree gave; 1 means no speedup) · tree budget and where it came from (profile: measured "
    "for this machine by `offspec profile`, estimate: timed at start-up, default: built in, fixed: set in "
    "Settings) · target pass time split into waiting for "
    "streamed weights and computing · device, memory use and the models (target ⇐ draft).\n\n"
    "Tree panel: the last pass's tree. The accepted path is green, the target's own (bonus) token cyan; each "
    "depth lists how many nodes were drafted there and the largest rejected drafts with their subtree sizes."
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q,question_mark", "close", "Close")]

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-height: 90%; border: thick $accent; background: $surface;
                                  padding: 1 2; height: auto; }
    HelpScreen .title { text-style: bold; color: $accent; margin-bottom: 1; }
    HelpScreen .notes { margin-top: 1; color: $text-muted; }
    """

    def __init__(self, keys: Sequence[tuple[str, str]]):
        super().__init__()
        self.keys = list(keys)

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 3))
        table.add_column(style="bold")
        table.add_column()
        for key, description in self.keys:
            table.add_row(Text(key), Text(description))
        with VerticalScroll():
            yield Static("offspec chat — keys (Esc closes)", classes="title")
            yield Static(table)
            yield Static(STATUS_HELP, classes="notes")

    def action_close(self) -> None:
        self.dismiss(None)
