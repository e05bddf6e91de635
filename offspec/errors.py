"""User-facing errors: one line that says what went wrong and what to do."""


class OffspecError(Exception):
    """An error caused by user input or environment, shown as a single line (never a traceback)."""


def run_cli(command, interrupted: str = "interrupted") -> int:
    """Run a CLI command (a no-argument callable returning an exit code): a user-fixable error is one line on
    stderr with exit 2, Ctrl-C is `interrupted` with exit 130. Every `offspec` sub-command goes through here."""
    import sys

    try:
        return command()
    except OffspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
