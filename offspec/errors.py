"""User-facing errors: one line that says what went wrong and what to do."""


class OffspecError(Exception):
    """An error caused by user input or environment, shown as a single line (never a traceback)."""
