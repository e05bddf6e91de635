"""The status line: speed of the current or last reply, and where the model runs with its memory use."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: 2; padding: 0 1; background: $panel; color: $text; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.speed, self.system = "", ""

    def show(self, speed: str | None = None, system: str | None = None) -> None:
        if speed is not None:
            self.speed = speed
        if system is not None:
            self.system = system
        text = Text(self.speed, style="bold")
        text.append("\n")
        text.append(self.system, style="dim")
        self.update(text)

    @property
    def text(self) -> str:
        return f"{self.speed}\n{self.system}"
