"""What the chat history store (`tui/history.py`) and its repair (`tui/history_repair.py`) share: the
status values of a stored message and the history's errors."""

from __future__ import annotations

from offspec.errors import OffspecError

# Message status values.
DONE, STREAMING, CANCELLED, INTERRUPTED, ERROR = "done", "streaming", "cancelled", "interrupted", "error"


class HistoryError(OffspecError):
    """The history database failed (full disk, read-only, damaged): a one-line reason that says what to do."""


class HistoryDamaged(HistoryError):
    """The database file is damaged (SQLite reports it malformed or not a database)."""
