"""Chat settings: one frozen dataclass holds every default; form text is parsed into it with one-line errors."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from offspec.config import DRAFTERS, generation_configs
from offspec.errors import OffspecError

AUTO = "auto"


@dataclass(frozen=True)
class ChatSettings:
    """What each chat turn asks of the engine. The only place the chat's defaults live.

    The settings form (F2) edits and saves the `SAVED` fields; `offspec chat --temperature ...` and the other
    generation flags of `offspec generate` override any field for one session (`with_options`)."""

    temperature: float = 0.7
    top_p: float = 0.95
    budget: Optional[int] = None  # tree budget; None = "auto": the engine's default (a measured profile or built-in)
    drafter: Optional[str] = None  # model, suffix or hybrid; None = "auto": the loaded default (hybrid with a draft)
    max_new_tokens: int = 1024  # a reply stops after this many tokens
    system_prompt: str = ""  # the system prompt given to new chats
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None  # None = a fresh seed each reply
    stop: tuple[str, ...] = ()  # stop strings
    speculate: bool = True  # False = the target alone (the baseline)

    SAVED = ("temperature", "top_p", "budget", "drafter", "max_new_tokens", "system_prompt")

    def validate(self) -> "ChatSettings":
        generation_configs({name: getattr(self, name) for name in GENERATION_FIELDS})
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget <= 0):
            raise OffspecError(f"budget must be 'auto' or a positive whole number, got {self.budget!r}")
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise OffspecError(f"drafter must be auto, {', '.join(DRAFTERS)}, got {self.drafter!r}")
        return self

    def with_options(self, options: dict[str, Any]) -> "ChatSettings":
        """These settings with generation options (by `offspec generate`'s option names) in force; checked."""
        unknown = sorted(set(options) - set(GENERATION_FIELDS))
        if unknown:
            raise OffspecError(f"unknown chat option(s): {', '.join(unknown)}")
        changes = dict(options)
        if "stop" in changes:
            changes["stop"] = tuple(changes["stop"] or ())
        return replace(self, **changes).validate()

    def generation_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `GeneratorLike.stream` these settings control."""
        return {"budget": self.budget, "drafter": self.drafter, **{name: getattr(self, name) for name in GENERATION_FIELDS}}

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.SAVED}, sort_keys=True)

    @classmethod
    def from_json(cls, text: Optional[str]) -> "ChatSettings":
        """Settings saved by any version: unknown keys are dropped, invalid values fall back to the defaults."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
            return cls(**{k: v for k, v in data.items() if k in cls.SAVED}).validate()
        except (ValueError, TypeError, AttributeError, OffspecError):
            return cls()


# the options of `offspec generate` that a chat turn takes too (the CLI flags of both commands)
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "speculate")


def format_budget(budget: Optional[int]) -> str:
    return AUTO if budget is None else str(budget)


def parse_budget(text: str) -> Optional[int]:
    """'auto' (or empty) -> None; a positive whole number -> int; anything else -> OffspecError."""
    value = text.strip().lower()
    if value in ("", AUTO):
        return None
    try:
        budget = int(value)
    except ValueError:
        raise OffspecError(f"budget must be 'auto' or a positive whole number such as 64, got {text.strip()!r}") from None
    if budget <= 0:
        raise OffspecError(f"budget must be 'auto' or a positive whole number such as 64, got {budget}")
    return budget


def format_drafter(drafter: Optional[str]) -> str:
    return AUTO if drafter is None else drafter


def parse_drafter(text: str) -> Optional[str]:
    """'auto' (or empty) -> None; model, suffix or hybrid -> itself; anything else -> OffspecError."""
    value = text.strip().lower()
    if value in ("", AUTO):
        return None
    if value not in DRAFTERS:
        raise OffspecError(f"drafter must be auto, {', '.join(DRAFTERS)}, got {text.strip()!r}")
    return value


def _parse_float(name: str, text: str, example: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise OffspecError(f"{name} must be a number such as {example}, got {text.strip()!r}") from None
    if not math.isfinite(value):
        raise OffspecError(f"{name} must be a finite number such as {example}, got {text.strip()!r}")
    return value


def _parse_int(name: str, text: str, example: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise OffspecError(f"{name} must be a whole number such as {example}, got {text.strip()!r}") from None


def parse_settings(base: ChatSettings, *, temperature: str, top_p: str, budget: str, max_new_tokens: str,
                   system_prompt: str, drafter: str = AUTO) -> ChatSettings:
    """Settings from the text of the settings form; raises OffspecError with a one-line message."""
    return replace(
        base,
        temperature=_parse_float("temperature", temperature, "0.7 (0 = greedy)"),
        top_p=_parse_float("top-p", top_p, "0.95"),
        budget=parse_budget(budget),
        drafter=parse_drafter(drafter),
        max_new_tokens=_parse_int("max tokens", max_new_tokens, "1024"),
        system_prompt=system_prompt.strip(),
    ).validate()
