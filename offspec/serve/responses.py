"""OpenAI response bodies built from offspec's results: whole answers, stream chunks, usage, speculation.

Besides OpenAI's fields, every answer (and the last chunk of a stream) carries `offspec`, the speculative
decoding statistics (see `speculation`); `usage.prompt_tokens_details.cached_tokens` counts the prompt
tokens whose KV cache was reused from the previous request.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from offspec.types import GenerationResult

# offspec's stop reasons -> OpenAI's finish_reason ("cancelled" never reaches a client that is still there)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context": "length"}


def finish_reason(result: GenerationResult) -> str:
    return FINISH_REASONS.get(result.stop_reason, "stop")


def usage(result: GenerationResult) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": result.reused_prompt_tokens}}


def speculation(result: GenerationResult, queued_seconds: float) -> dict:
    """The documented `offspec` field: how the answer was decoded, so clients can show speed."""
    return {
        "passes": result.n_passes,  # target forward passes
        "tokens_per_pass": round(result.tokens_per_pass, 4),
        "budget": result.passes[-1].budget if result.passes else 0,  # tree budget of the last pass; 0 = target alone
        "draft_seconds": round(result.draft_seconds, 4),  # growing trees with the draft model
        "target_seconds": round(result.target_seconds, 4),  # the target's passes (verification)
        "seconds": round(result.seconds, 4),  # the whole decode, prefill included
        "tokens_per_second": round(result.tokens_per_second, 4),
        "queued_seconds": round(queued_seconds, 4),  # waiting behind other requests
        "stop_reason": result.stop_reason,  # offspec's own: eos, stop, max_tokens, context
    }


class Shape:
    """The answers of one request: `chat.completion` (+ `.chunk`) or `text_completion`."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool = False):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _choice(self, text: Optional[str], finish: Optional[str], *, chunk: bool, role: bool = False) -> dict:
        choice: dict = {"index": 0}
        if not self.chat:
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice.update(logprobs=None, finish_reason=finish)
        return choice

    def whole(self, result: GenerationResult, queued_seconds: float) -> dict:
        """A non-streamed answer."""
        choice = self._choice(result.text, finish_reason(result), chunk=False)
        if self.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        return self._envelope(False) | {"choices": [choice], "usage": usage(result),
                                        "offspec": speculation(result, queued_seconds)}

    def first_chunk(self) -> dict:
        """A stream's first chunk: the role (chat), or an empty text (completions)."""
        return self._envelope(True) | {"choices": [self._choice("", None, chunk=True, role=True)]}

    def text_chunk(self, text: str) -> dict:
        return self._envelope(True) | {"choices": [self._choice(text, None, chunk=True)]}

    def last_chunk(self, result: GenerationResult, queued_seconds: float) -> dict:
        """The chunk with the finish_reason and the `offspec` statistics (token ids when asked for)."""
        choice = self._choice(None, finish_reason(result), chunk=True)
        if self.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        return self._envelope(True) | {"choices": [choice], "offspec": speculation(result, queued_seconds)}

    def usage_chunk(self, result: GenerationResult) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return self._envelope(True) | {"choices": [], "usage": usage(result)}
