"""OpenAI response bodies built from offspec's results: whole answers, stream chunks, usage, speculation.

Besides OpenAI's fields, every answer (and the last chunk of a stream) carries `offspec`, the speculative
decoding statistics (see `speculation`); `usage.prompt_tokens_details.cached_tokens` counts the prompt
tokens whose KV cache was reused from the previous request. A reasoning model's reasoning is `reasoning_content`
beside `content` (`message.reasoning_content`, `delta.reasoning_content`), only where it wrote some, as llama.cpp's
server gives it.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Optional, Sequence

from offspec.types import GenerationResult, TokenLogprob
from offspec.util.reasoning import Split

from .tools import Parsed, ToolCall

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
    return {**_experts(result),
        "passes": result.n_passes,  # target forward passes
        "tokens_per_pass": round(result.tokens_per_pass, 4),
        "budget": result.passes[-1].budget if result.passes else 0,  # tree budget of the last pass; 0 = target alone
        "draft_seconds": round(result.draft_seconds, 4),  # growing trees with the draft model
        "target_seconds": round(result.target_seconds, 4),  # the target's passes (verification)
        "seconds": round(result.seconds, 4),  # the whole decode, prefill included
        "prefill_seconds": round(result.prefill_seconds, 4),  # the prompt's part of it (uncached tokens)
        "tokens_per_second": round(result.tokens_per_second, 4),
        "queued_seconds": round(queued_seconds, 4),  # waiting behind other requests
        "stop_reason": result.stop_reason,  # offspec's own: eos, stop, max_tokens, context
    }


def _experts(result: GenerationResult) -> dict:
    """A mixture whose experts are read as routed: the experts its passes ran and how many the cache held."""
    routed = sum(p.experts_routed for p in result.passes)
    if not routed:
        return {}
    hits = sum(p.expert_hits for p in result.passes)
    return {"experts_routed": routed, "expert_hits": hits, "experts_read": routed - hits}


class Shape:
    """The answers of one request: `chat.completion` (+ `.chunk`) or `text_completion`. `token_bytes`: a token id's
    bytes (log-probabilities name their tokens by them)."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool = False,
                 token_bytes: Optional[Callable[[int], bytes]] = None):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.token_bytes = token_bytes
        self._offset = 0  # completions: the text offset of the next token's log-probability
        self._calls = 0  # tool calls sent in the stream so far (the next one's index)

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _choice(self, text: Optional[str], finish: Optional[str], *, chunk: bool, role: bool = False,
                logprobs: Optional[Sequence[TokenLogprob]] = None, calls: Sequence[ToolCall] = (),
                reasoning: str = "") -> dict:
        choice: dict = {"index": 0}
        thought = {"reasoning_content": reasoning} if reasoning else {}
        if not self.chat:
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice["delta"] |= thought
            if calls:
                choice["delta"]["tool_calls"] = [c.openai(index=i) for i, c in enumerate(calls, start=self._calls)]
                self._calls += len(calls)
        else:
            choice["message"] = {"role": "assistant", "content": text} | thought
            if calls:
                choice["message"]["tool_calls"] = [c.openai() for c in calls]
        choice.update(logprobs=self._logprobs(logprobs) if logprobs is not None else None, finish_reason=finish)
        return choice

    def _token(self, token: int) -> tuple[str, list[int]]:
        data = self.token_bytes(token) if self.token_bytes is not None else b""
        return data.decode("utf-8", errors="replace"), list(data)

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """OpenAI's `logprobs` object: chat's {"content": [...]}, or completions' parallel lists."""
        if self.chat:
            content = []
            for lp in logprobs:
                text, data = self._token(lp.token)
                top = [dict(zip(("token", "bytes"), self._token(t)), logprob=v) for t, v in lp.top]
                content.append({"token": text, "logprob": lp.logprob, "bytes": data, "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self._token(lp.token)[0])
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._token(t)[0]: v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def whole(self, result: GenerationResult, queued_seconds: float, parsed: Optional[Parsed] = None,
              split: Optional[Split] = None) -> dict:
        """A non-streamed answer; `parsed`: its tool calls (and the text beside them); `split`: its text split into
        reasoning and answer (None: all of `result.text` is the answer)."""
        reasoning = split.reasoning if split is not None else ""
        if parsed is not None:
            choice = self._choice(parsed.content, "tool_calls", chunk=False, calls=parsed.calls,
                                  logprobs=result.logprobs, reasoning=reasoning)
        else:
            choice = self._choice(split.answer if split is not None else result.text, finish_reason(result),
                                  chunk=False, logprobs=result.logprobs, reasoning=reasoning)
        if self.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        return self._envelope(False) | {"choices": [choice], "usage": usage(result),
                                        "offspec": speculation(result, queued_seconds)}

    def first_chunk(self) -> dict:
        """A stream's first chunk: the role (chat), or an empty text (completions)."""
        return self._envelope(True) | {"choices": [self._choice("", None, chunk=True, role=True)]}

    def text_chunk(self, text: Optional[str], logprobs: Optional[Sequence[TokenLogprob]] = None,
                   reasoning: str = "") -> dict:
        """New text: `text` as the content (None: none in this chunk), `reasoning` as `reasoning_content`."""
        return self._envelope(True) | {"choices": [self._choice(text, None, chunk=True, logprobs=logprobs,
                                                                reasoning=reasoning)]}

    def tool_chunk(self, calls: Sequence[ToolCall]) -> dict:
        """Tool calls, each whole (name and arguments), as `delta.tool_calls`."""
        return self._envelope(True) | {"choices": [self._choice(None, None, chunk=True, calls=calls)]}

    def last_chunk(self, result: GenerationResult, queued_seconds: float, finish: Optional[str] = None) -> dict:
        """The chunk with the finish_reason and the `offspec` statistics (token ids when asked for)."""
        choice = self._choice(None, finish or finish_reason(result), chunk=True)
        if self.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        return self._envelope(True) | {"choices": [choice], "offspec": speculation(result, queued_seconds)}

    def usage_chunk(self, result: GenerationResult) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return self._envelope(True) | {"choices": [], "usage": usage(result)}
