"""Prompt files for benchmarks and calibration.

Accepted formats: JSONL with {"turns": [...]} (MT-Bench style; the first turn is used), JSONL with
{"prompt": ...}, or plain text with one prompt per line. A bad line is an error naming the line.
"""

from __future__ import annotations

import json
from pathlib import Path

from offspec.errors import OffspecError


def read_prompts(path: str | Path, n: int | None = None) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise OffspecError(f"prompt file {path} not found; pass a JSONL or a text file with one prompt per line")
    prompts: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise OffspecError(f"prompt file {path} is not UTF-8 text") from None
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        if text.startswith("{"):
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise OffspecError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
                prompts.append(record["turns"][0])
            elif isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                raise OffspecError(f'{path}:{number}: expected {{"turns": ["..."]}} or {{"prompt": "..."}}')
        else:
            prompts.append(text)
        if n is not None and len(prompts) >= n:
            break
    if not prompts:
        raise OffspecError(f"prompt file {path} holds no prompts")
    return prompts
