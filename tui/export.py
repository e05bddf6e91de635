"""Exporting a chat to a Markdown file."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional, Sequence

from offspec.types import ModelInfo
from offspec.util.files import atomic_write

from .history import StoredMessage
from .history_base import DONE

EXPORT_DIRNAME = "exports"
ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


def slug(text: str, limit: int = 40) -> str:
    value = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return value[:limit].rstrip("-") or "chat"


def chat_markdown(title: str, system_prompt: str, messages: Sequence[StoredMessage],
                  info: Optional[ModelInfo] = None, exported_at: Optional[float] = None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(exported_at or time.time()))
    lines = [f"# {title}", ""]
    meta = f"Exported from offspec chat on {when}"
    if info is not None:
        meta += f" · target `{info.target}`, draft `{info.draft}` on {info.device}"
    lines += [f"_{meta}_", ""]
    if system_prompt:
        lines += ["## System", "", system_prompt, ""]
    for message in messages:
        heading = ROLE_TITLES.get(message.role, message.role.title())
        if message.status != DONE:
            heading += f" ({message.status})"
        lines += [f"## {heading}", ""]
        if message.reasoning:  # folded, as the chat shows it (GitHub and most Markdown viewers fold <details>)
            lines += ["<details><summary>Reasoning</summary>", "", message.reasoning, "", "</details>", ""]
        lines += [message.content, ""]
    return "\n".join(lines).rstrip() + "\n"


def export_chat(data_dir: Path, chat_id: Optional[int], title: str, system_prompt: str,
                messages: Sequence[StoredMessage], info: Optional[ModelInfo] = None) -> Path:
    """Write the chat to `<data_dir>/exports/<date>-<title>.md` (never overwriting) and return the path."""
    folder = Path(data_dir) / EXPORT_DIRNAME
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(title)}" + (f"-{chat_id}" if chat_id is not None else "")
    path = folder / f"{stem}.md"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.md"
    atomic_write(path, chat_markdown(title, system_prompt, messages, info), fsync=False)
    return path
