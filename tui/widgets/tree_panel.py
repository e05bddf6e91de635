"""The toggleable panel with the last pass's speculation tree."""

from __future__ import annotations

from typing import Optional

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from offspec.types import TreeSnapshot

from ..tree_view import Decode, TokenLabels, render_tree


class TreePanel(VerticalScroll, can_focus=False):
    DEFAULT_CSS = """
    TreePanel { width: 56; border-left: solid $primary 50%; padding: 0 1; display: none; }
    TreePanel.visible { display: block; }
    TreePanel > .title { text-style: bold; color: $accent; }
    """

    def __init__(self, decode: Optional[Decode] = None, **kwargs):
        super().__init__(**kwargs)
        self.labels = TokenLabels(decode)
        self.snapshot: Optional[TreeSnapshot] = None
        self._stale = True

    def compose(self) -> ComposeResult:
        yield Static("Speculation tree (last pass)", classes="title")
        yield Static(render_tree(None), id="tree-text")

    @property
    def is_shown(self) -> bool:
        return self.has_class("visible")

    def toggle(self) -> bool:
        self.toggle_class("visible")
        if self.is_shown and self._stale:
            self._redraw()
        return self.is_shown

    def show_tree(self, tree: TreeSnapshot) -> None:
        """Remember the latest tree; render it only while the panel is visible."""
        self.snapshot, self._stale = tree, True
        if self.is_shown:
            self._redraw()

    def _redraw(self) -> None:
        self.query_one("#tree-text", Static).update(render_tree(self.snapshot, labels=self.labels))
        self._stale = False
