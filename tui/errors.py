"""Turning exceptions into one-line messages and advice for the UI; tracebacks go to a log file."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from offspec.errors import OffspecError

ERROR_LOG = "chat-errors.log"


def describe(error: BaseException) -> str:
    """One line: the message of a user error, `Type: message` for anything else."""
    text = " ".join(str(error).split()) or error.__class__.__name__
    if isinstance(error, OffspecError):
        return text
    return f"{error.__class__.__name__}: {text}" if str(error) else text


def advice(error: BaseException, log_path: Path | None = None) -> str:
    """What the user can do about `error`."""
    name = error.__class__.__name__
    if isinstance(error, OffspecError):
        return "Fix the option named above and start `offspec chat` again (`offspec chat --help` lists them)."
    if isinstance(error, MemoryError) or "OutOfMemory" in name:
        return ("Not enough memory: try a smaller target or draft, --dtype bfloat16, a smaller --max-context, "
                "or a smaller tree --budget.")
    if isinstance(error, FileNotFoundError):
        return "A model file is missing: check the --target and --draft paths or names."
    if isinstance(error, ImportError):
        return "A dependency is missing or broken: reinstall offspec with its requirements."
    where = f" The traceback is in {log_path}." if log_path else ""
    return f"This looks like a bug in offspec.{where} Please report it with that file."


def is_user_error(error: BaseException) -> bool:
    return isinstance(error, OffspecError)


def write_error_log(data_dir: Path, error: BaseException, context: str) -> Path | None:
    """Append `error`'s traceback to `<data_dir>/chat-errors.log`; None if that fails."""
    path = Path(data_dir) / ERROR_LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {context}\n")
            log.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    except OSError:
        return None
    return path
