"""A draft made from the target reads the target's KV cache (offspec.spec.kvcache.BorrowedKVCache): it never
prefills or catches up on committed tokens, and the target never reads a key or value it did not compute."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_gguf import save_tiny_gguf

import offspec
from offspec.spec.kvcache import BorrowedKVCache, SlotKVCache

PROMPT = [5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7, 18, 64, 90]


def _write(cache: SlotKVCache, slots: list[int], positions: list[int], value: float) -> None:
    """Write keys and values of `value` at `slots` in both layers (as a forward's attention layers would)."""
    slot_t = torch.tensor(slots)
    cache.prepare(slot_t, max(slots) + 1, torch.tensor(positions))
    kv = torch.full((1, 2, len(slots), 4), value)  # (1, kv_heads, q, head_dim)
    for layer in range(2):
        cache.update(kv, kv, layer)


def test_a_borrowed_cache_reads_the_owners_buffers_and_writes_only_after_its_committed_slots():
    owner = SlotKVCache(num_layers=2, capacity=16)
    _write(owner, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 1.0)
    owner.length = 5
    draft = BorrowedKVCache(owner)
    assert draft.capacity == 16 and draft.keys is owner.keys and draft.values is owner.values
    draft.follow()
    assert draft.length == 5
    _write(draft, [5, 6, 7], [5, 9, 9], 2.0)  # the root and two scratch nodes of the draft's tree
    assert torch.equal(owner.keys[0][0, 0, :8, 0], torch.tensor([1.0] * 5 + [2.0] * 3))  # one buffer for both
    with pytest.raises(RuntimeError, match="wrote slot 4, below the target's 5 committed slots"):
        _write(draft, [4, 8], [4, 8], 3.0)
    assert float(owner.keys[1][0, 0, 4, 0]) == 1.0  # the refused write left the target's keys alone
    with pytest.raises(RuntimeError, match="keeps nothing"):
        draft.keep(torch.tensor([5]), 6)
    # the target's pass writes its own root and path over the draft's slots, then commits two of them
    _write(owner, [5, 6, 7], [5, 6, 6], 4.0)
    owner.keep(torch.tensor([5, 7]), 7)
    draft.follow()
    assert draft.length == 7
    assert draft.positions[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 9]  # committed slots at their own positions again
    owner.truncate(3)  # a new prompt shares 3 tokens: the draft follows down
    draft.follow()
    assert draft.length == 3 and draft.positions[:3].tolist() == [0, 1, 2]


def test_self_reads_the_targets_cache_and_the_target_computes_every_key_it_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = save_tiny_gguf(tmp_path / "target.gguf", "qwen2", seed=0, hidden=256, inter=512, layers=4)
    options = dict(max_context=256, max_budget=64)
    alone = offspec.load(str(target), "none", **options)
    expected = alone.generate(PROMPT, max_new_tokens=32, speculate=False)
    gen = offspec.load(str(target), "self", **options)
    runner, draft = gen.engine.target, gen.engine.drafter.model.runner
    assert draft.borrows and draft.cache.keys is runner.cache.keys and draft.capacity == runner.capacity
    result = gen.generate(PROMPT, max_new_tokens=32, budget=16, drafter="model")
    assert result.token_ids == expected.token_ids
    model_passes = [p for p in result.passes if p.drafter == "model"]
    assert model_passes and all(p.caught_up == 1 for p in model_passes)  # the root only: no prefill, no catch-up
    assert sum(p.accepted for p in model_passes) > 0
    # the target's keys and values of the committed tokens are the bits it computes decoding alone
    length = runner.length
    assert length == alone.engine.target.length == len(PROMPT) + 32 - 1
    for mine, theirs in zip(runner.cache.keys + runner.cache.values,
                            alone.engine.target.cache.keys + alone.engine.target.cache.values):
        assert torch.equal(mine[:, :, :length], theirs[:, :, :length])


def test_after_suffix_passes_the_borrowing_draft_runs_only_the_root(tmp_path, monkeypatch):
    """The hybrid's suffix-only passes commit tokens the draft never ran: a borrowing draft has their keys and values
    from the target all the same, so its next tree catches up on the root alone."""
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = save_tiny_gguf(tmp_path / "target.gguf", "qwen2", seed=0, hidden=256, inter=512, layers=4)
    options = dict(max_context=256, max_budget=64)
    repeated = PROMPT * 6  # a long repeat: the suffix drafter's confident matches, passes without the model
    expected = offspec.load(str(target), "none", **options).generate(repeated, max_new_tokens=48, speculate=False)
    gen = offspec.load(str(target), "self", **options)
    result = gen.generate(repeated, max_new_tokens=48, budget=16, drafter="hybrid")
    assert result.token_ids == expected.token_ids
    passes = result.passes
    first = next(i for i, p in enumerate(passes) if p.drafter != "suffix")  # the first pass that ran the draft
    assert first >= 1, [p.drafter for p in passes]  # after a suffix-only pass: the draft never ran before it
    assert passes[first].caught_up == 1  # not the 84-token prompt and that pass's tokens: the root alone
    assert all(p.caught_up <= 1 for p in passes)
