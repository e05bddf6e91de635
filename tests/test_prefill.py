"""Prefill of a streamed target: as few passes as the activation reserve allows (each pass streams every layer),
each pass within that reserve, and the output still the target's own greedy decoding."""

import re

import pytest
import torch

import offspec
from offspec import OffspecError
from offspec.offload.estimates import activation_bytes
from offspec.offload.prefill import largest_chunk
from offspec.spec.runner import PREFILL_CHUNK, ModelRunner

PROMPT = "Tell me everything about caches. " * 24  # 792 characters: about 800 tokens (one byte each)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("prefill")
    # layers of 1.3 MB: more than the suggested budget's rounding (to a MB) can hold, so that budget streams some
    target = save_tiny_model(root / "target", arch="llama", seed=0, logit_scale=3.0, layers=6, hidden=192,
                             max_pos=2048)
    draft = save_tiny_model(root / "draft", arch="llama", seed=0, logit_scale=3.0, noise=0.02, max_pos=2048)
    return target, draft


def _streamed(pair, tmp_path, monkeypatch, **options):
    target, draft = pair
    # the process's runtime memory (part of a CPU budget) is measured at each load and differs between the two loads:
    # held fixed here, so the suggested budget is the smallest for this placement at the second load too
    monkeypatch.setattr("offspec.offload.model.measured_runtime", lambda: 300_000_000)
    with pytest.raises(OffspecError) as info:  # the smallest budget: as many layers streamed as can be
        offspec.load(str(target), str(draft), device_mem="1KB", offload_dir=str(tmp_path), **options)
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    return offspec.load(str(target), str(draft), device_mem=budget, offload_dir=str(tmp_path), **options)


def _record_passes(gen, monkeypatch):
    """(tokens, cache length) of every target pass."""
    passes = []
    runner = gen.engine.target
    forward = ModelRunner.forward

    def recording(self, tokens, positions, slots, visible):
        if self is runner:
            passes.append(tuple(visible.shape))
        return forward(self, tokens, positions, slots, visible)

    monkeypatch.setattr(ModelRunner, "forward", recording)
    return passes


def test_largest_chunk_is_the_most_tokens_whose_activations_fit_the_reserve(pair):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(pair[0]))
    reserve = activation_bytes(config, 65, 1024 + 65, 4)  # a 64-node tree over a 1024-token context
    for cached, remaining in ((0, 5000), (300, 5000), (900, 40), (0, 1)):
        q = largest_chunk(config, reserve, cached, remaining, 4)
        assert 1 <= q <= remaining and activation_bytes(config, q, cached + q, 4) <= reserve
        assert q == remaining or activation_bytes(config, q + 1, cached + q + 1, 4) > reserve
    assert largest_chunk(config, 0, 0, 10, 4) == 1  # one token always runs


@pytest.mark.slow
def test_a_streamed_target_prefills_a_long_prompt_in_one_pass_when_the_reserve_allows(pair, tmp_path, monkeypatch):
    options = dict(dtype="float32", max_context=1024, max_budget=900, budget=8)
    gen = _streamed(pair, tmp_path, monkeypatch, **options)
    placement = gen.info.extra["placement"]
    assert placement["layers"]["ssd"] >= 1
    ids = gen.encode(PROMPT)
    assert len(ids) > PREFILL_CHUNK  # the old fixed chunk would stream the model twice
    passes = _record_passes(gen, monkeypatch)
    io0 = gen.engine.target.io_counters()[0]
    gen.engine.reset_to(ids)
    assert passes == [(len(ids) - 1, len(ids) - 1)]  # the whole prompt but its last token, in one pass
    assert gen.engine.target.io_counters()[0] - io0 == placement["bytes_per_pass"]  # the layers streamed once


def test_prefill_chunks_stay_within_the_activation_reserve_and_decoding_stays_lossless(pair, tmp_path, monkeypatch):
    options = dict(dtype="float32", max_context=1024, max_budget=16, budget=8)
    gen = _streamed(pair, tmp_path, monkeypatch, **options)
    reserve = gen.info.extra["placement"]["sizes"]["activation_bytes"]
    config = gen.engine.target.model.config
    passes = _record_passes(gen, monkeypatch)
    trims = []  # a CPU budget holds the whole process: the heap is trimmed after each streamed pass
    monkeypatch.setattr("offspec.offload.materialize.trim_heap", lambda collect: trims.append(collect))
    result = gen.generate(PROMPT, max_new_tokens=12)
    assert trims == [False] * len(passes)  # once per target pass, without a garbage collection
    n = len(gen.encode(PROMPT)) - 1  # prefilled: all but the last token
    prefill = passes[: next(i for i, (q, kv) in enumerate(passes) if kv == n) + 1]
    assert sum(q for q, _ in prefill) == n
    assert all(activation_bytes(config, q, kv, 4) <= reserve for q, kv in prefill)  # within the reserve
    # each pass the largest chunk the reserve holds: the fewest passes (at the smallest budget the loader lowers the
    # reserve's prefill pass to fit, whatever limits were given: issue 63)
    assert all(q == largest_chunk(config, reserve, kv - q, n - (kv - q), 4) for q, kv in prefill)
    monkeypatch.undo()
    in_memory = offspec.load(str(pair[0]), str(pair[1]), **options)
    plain = in_memory.generate(PROMPT, max_new_tokens=12, speculate=False)
    assert result.token_ids == plain.token_ids
    assert torch.equal(torch.tensor(result.token_ids), torch.tensor(plain.token_ids))
