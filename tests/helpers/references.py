"""What the family tests compare offspec with: transformers' own model of a converted GGUF, and one causal pass of
offspec's runner (tests/test_families.py, tests/test_moe.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from offspec.store.entry import converted_dir, gguf_key


def transformers_reference(gguf: Path):
    """transformers' own model of the file, float32, with the config offspec derived from it (saved in its cache
    entry: the file must have been converted)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(converted_dir(gguf_key(gguf))))
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                config=config).eval()


def causal(runner, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), hidden) final hidden states of `tokens` from an empty cache, in one causal pass."""
    runner.cache.truncate(0)
    pos = torch.arange(len(tokens))  # (q,)
    visible = torch.ones((len(tokens), len(tokens)), dtype=torch.bool).tril()  # (q, q)
    return runner.forward(torch.tensor(tokens), pos, pos, visible)
