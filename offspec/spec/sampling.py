"""Choosing the target's token from its logits: greedy, or sampling with temperature / top-k / top-p.

The same function serves speculative verification and plain autoregressive decoding, so both follow
exactly the same distribution. The warpers are transformers' own logits processors.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from offspec.config import SamplingConfig


class TokenChooser:
    def __init__(self, sampling: SamplingConfig, device: torch.device):
        self.sampling = sampling
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
        if self.sampling.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))


def draft_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(k, V) draft logits -> (k, V) float32 log-probs that rank the draft's children.

    When the target samples at temperature T, the draft's ranking uses the same temperature; this only
    changes which tokens are proposed, never what is emitted.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)
