"""User-facing errors: one line that says what went wrong and what to do."""


class OffspecError(Exception):
    """An error caused by user input or environment, shown as a single line (never a traceback)."""


def run_cli(command, interrupted: str = "interrupted") -> int:
    """Run a CLI command (a no-argument callable returning an exit code): a user-fixable error is one line on
    stderr with exit 2, Ctrl-C is `interrupted` with exit 130. Every `offspec` sub-command goes through here."""
    import atexit
    import sys

    atexit.unregister(_quick_exit)  # once, however many commands a process runs (tests run them in-process)
    atexit.register(_quick_exit)  # before the command's own handlers, so it runs after them
    try:
        return command()
    except OffspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def _quick_exit() -> None:
    """At exit, after the other atexit handlers: what is left needs no collecting (the interpreter's last collection
    walked torch's and transformers' objects for about a second per command). Not with Triton loaded: its nanobind
    bindings report every object left uncollected at exit as a leak."""
    import gc
    import sys

    if "triton" not in sys.modules:
        gc.freeze()
