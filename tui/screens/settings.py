"""The settings form: temperature, top-p, tree budget (auto or a number), drafter, reply length, system prompt."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from offspec.errors import OffspecError

from ..settings import ChatSettings, format_budget, format_drafter, parse_settings

FIELDS = (  # (input id, label, placeholder)
    ("temperature", "Temperature", "0 = greedy, e.g. 0.7"),
    ("top_p", "Top-p", "in (0, 1], e.g. 0.95"),
    ("budget", "Tree budget", "auto, or draft tokens per pass, e.g. 64"),
    ("drafter", "Drafter", "auto, model, suffix (text already seen) or hybrid (both)"),
    ("max_new_tokens", "Max tokens", "reply length limit, e.g. 1024"),
)


class SettingsScreen(ModalScreen["ChatSettings | None"]):
    """Dismissed with the new settings, or None when cancelled. Bad input shows one line and keeps the form."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Vertical { width: 80; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    SettingsScreen .title { text-style: bold; color: $accent; }
    SettingsScreen Grid { grid-size: 2; grid-columns: 16 1fr; grid-rows: 3; height: auto; margin-top: 1; }
    SettingsScreen Grid Label { padding-top: 1; }
    SettingsScreen TextArea { height: 6; }
    SettingsScreen #settings-error { color: $error; height: auto; margin-top: 1; }
    SettingsScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    SettingsScreen Button { margin-left: 1; }
    """

    def __init__(self, settings: ChatSettings, system_prompt: str):
        super().__init__()
        self.settings, self.system_prompt = settings, system_prompt

    def compose(self) -> ComposeResult:
        values = {
            "temperature": f"{self.settings.temperature:g}",
            "top_p": f"{self.settings.top_p:g}",
            "budget": format_budget(self.settings.budget),
            "drafter": format_drafter(self.settings.drafter),
            "max_new_tokens": str(self.settings.max_new_tokens),
        }
        with Vertical():
            yield Static("Settings (Enter or ctrl+s saves, Esc cancels)", classes="title")
            with Grid():
                for field_id, label, placeholder in FIELDS:
                    yield Label(label)
                    yield Input(values[field_id], placeholder=placeholder, id=field_id)
            yield Label("System prompt (this chat, and new chats)")
            yield TextArea(self.system_prompt, id="system_prompt")
            yield Static("", id="settings-error")
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#temperature", Input).focus()

    def read(self) -> ChatSettings:
        """The form's settings; raises OffspecError (one line) for bad input."""
        text = {field_id: self.query_one(f"#{field_id}", Input).value for field_id, _, _ in FIELDS}
        return parse_settings(self.settings, system_prompt=self.query_one("#system_prompt", TextArea).text, **text)

    def action_save(self) -> None:
        try:
            settings = self.read()
        except OffspecError as error:
            self.query_one("#settings-error", Static).update(Text(f"✗ {error}"))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()
