"""Choosing the target's token from its logits: greedy, or sampling with temperature / top-k / top-p, optionally
under a grammar's mask, recording the log-probabilities of the tokens it chose.

The same chooser serves speculative verification and plain autoregressive decoding, so both follow exactly the same
distribution: the acceptance walk calls `choose` once per emitted token, in order (the accepted path's tokens, then
the bonus), as decoding without a draft does. The warpers are transformers' own logits processors.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from offspec.config import SamplingConfig
from offspec.errors import OffspecError
from offspec.types import TokenLogprob

from .grammar import TokenGrammar


class TokenChooser:
    """`grammar`: the output's grammar, whose state advances with every token chosen. `logprobs` (None: off): record
    each chosen token's log-probability and that many likeliest alternatives', from the target's own distribution
    (the log-softmax of its logits, before a grammar's mask, temperature, top-k or top-p; what vLLM's and llama.cpp's
    servers report)."""

    def __init__(self, sampling: SamplingConfig, device: torch.device, grammar: Optional[TokenGrammar] = None,
                 logprobs: Optional[int] = None):
        self.sampling = sampling
        self.grammar = grammar
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] = []  # one per chosen token, in order, when recording
        self.generator: Optional[torch.Generator] = None
        warpers = []
        if not sampling.greedy:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(sampling.top_p))
            self.generator = torch.Generator(device=device)
            if sampling.seed is not None:
                self.generator.manual_seed(sampling.seed)
            else:
                self.generator.seed()
        self.warpers = LogitsProcessorList(warpers)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(V,) logits -> (V,) float32 probabilities of the adjusted target distribution (sampling only)."""
        scores = self.warpers(None, logits.float()[None])  # (1, V)
        return torch.softmax(scores, dim=-1)[0]

    def choose(self, logits: torch.Tensor) -> int:
        """(V,) logits -> a token id. Syncs with the device: the caller needs the id on the host."""
        raw = logits
        if self.grammar is not None:
            logits = self._masked(logits)
        if self.sampling.greedy:
            token = int(torch.argmax(logits))
        else:
            token = int(torch.multinomial(self.probs(logits), 1, generator=self.generator))
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprob(raw, token, self.top_logprobs))
        if self.grammar is not None:
            self.grammar.advance(token)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.grammar.allowed()  # (V,) bool, on the host
        if not bool(allowed.any()):
            raise OffspecError("the output grammar allows no token here; check the schema or grammar")
        allowed = allowed.to(logits.device, non_blocking=True)
        return logits.float().masked_fill(~allowed[: logits.shape[-1]], float("-inf"))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under (V,) `logits`, and the `top` likeliest tokens' (most likely first)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    alternatives: tuple = ()
    if top > 0:
        best = torch.topk(logp, top)
        alternatives = tuple(zip(best.indices.tolist(), best.values.tolist()))  # sync: the host needs them
    return TokenLogprob(token=token, logprob=float(logp[token]), top=alternatives)


def draft_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(k, V) draft logits -> (k, V) float32 log-probs that rank the draft's children.

    When the target samples at temperature T, the draft's ranking uses the same temperature; this only
    changes which tokens are proposed, never what is emitted.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)
