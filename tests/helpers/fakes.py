"""Scripted fake models with hand-set logits, for exact expectations on tree growth and verification.

`BigramRunner` stands in for `offspec.spec.runner.ModelRunner`: its next-token log-probs depend only on the
current token, read from a table. Its "hidden state" is just the token id, so logits are exact.
"""

from __future__ import annotations

import math

import torch

from offspec.spec.kvcache import SlotKVCache


class BigramRunner:
    def __init__(self, table: dict[int, dict[int, float]], vocab: int = 16, capacity: int = 256):
        """table[token] = {next_token: probability}; missing mass is spread evenly over the rest."""
        self.vocab = vocab
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.capacity = capacity
        self.cache = SlotKVCache(1, capacity)
        self.logp = torch.full((vocab, vocab), -1e9)  # (vocab, vocab) row = current token
        for tok in range(vocab):
            row = table.get(tok, {})
            rest = max(0.0, 1.0 - sum(row.values()))
            others = [t for t in range(vocab) if t not in row]
            for t in range(vocab):
                p = row.get(t, rest / len(others) if others and rest > 0 else 0.0)
                self.logp[tok, t] = math.log(p) if p > 0 else -1e9
        self.forward_calls: list[dict] = []  # what each forward received, for assertions
        self.logits_rows: list[list[int]] = []  # the "hidden states" (token ids) of each logits call
        self.head_is_row_invariant = True  # a table lookup: the same row whatever the batch
        self.io = None  # nothing streams unless a test scripts it (`loading()`, `counters()`)
        self.borrows = False  # its own cache (ModelRunner.borrows: a self draft reads the target's)

    @property
    def vocab_size(self) -> int:
        """The width of its logits (ModelRunner.vocab_size): the ids a tree may hold."""
        return self.vocab

    def io_counters(self) -> tuple[int, float]:
        return self.io.counters() if self.io is not None else (0, 0.0)

    def expert_counters(self) -> tuple[int, int]:
        return (0, 0)  # a dense model: no experts read as routed (ModelRunner.expert_counters)

    def weights_loading(self) -> bool:
        return self.io is not None and self.io.loading()

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, tokens, positions, slots, visible):
        self.forward_calls.append(dict(tokens=tokens.tolist(), positions=positions.tolist(), slots=slots.tolist(),
                                       visible=visible.clone()))
        return tokens.float()[:, None]  # (q, 1): the "hidden state" is the token id

    def logits(self, hidden):
        self.logits_rows.append(hidden[..., 0].long().reshape(-1).tolist())
        return self.logp[hidden[..., 0].long()]

    def token_ids(self, indices):
        return indices  # a whole head: logits index i is token i

    def forget_tokens(self) -> None:
        pass

    def refresh_tokens(self, kept) -> None:
        pass

    def extend(self, tokens, chunk: int = 512):
        self.forward_calls.append(dict(extend=list(tokens)))
        self.cache.length += len(tokens)
        return torch.tensor([float(tokens[-1])])
