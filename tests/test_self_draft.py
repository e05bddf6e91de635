"""`--draft self`: the target's GGUF requantized to Q3_K (offspec/models/self_draft.py), built once into the cache,
loaded as an ordinary draft of the same tokenizer."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from helpers.tiny import save_tiny_model
from helpers.tiny_gguf import save_tiny_gguf

import offspec
from offspec import OffspecError
from offspec.formats import kquant
from offspec.models import self_draft
from offspec.models.self_draft import copy_path, self_copy, self_draft_type
from offspec.util.sizes import parse_size

LOAD = dict(max_context=256, max_budget=64)
PROMPT = [5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7, 18, 64, 90]
BLOCK_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return root


@pytest.fixture
def target(tmp_path):
    # hidden 256, inter 512: every block matrix has rows of a multiple of 256 values
    return save_tiny_gguf(tmp_path / "target.gguf", "qwen2", seed=0, hidden=256, inter=512, layers=2)


def _events(path, type_name="Q3_K"):
    events = []
    return self_copy(path, type_name, progress=events.append), events


def _is_block_weight(name: str) -> bool:
    return name.startswith("blk.") and name.endswith(".weight") and name.split(".")[2] in BLOCK_WEIGHTS


def test_the_copy_has_the_targets_tensors_metadata_and_tokenizer_with_q3_k_blocks(cache, target):
    copy, events = _events(target)
    assert copy.parent == cache / "self" and copy.is_file()
    src, out = gguf.GGUFReader(str(target)), gguf.GGUFReader(str(copy))
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]  # every tensor, in order
    assert set(out.fields) == set(src.fields)  # every metadata key
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.model", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id",
                "general.architecture", "qwen2.embedding_length", "qwen2.block_count"):
        assert out.fields[key].contents() == src.fields[key].contents(), key
        assert out.fields[key].types == src.fields[key].types, key
    assert out.fields["general.name"].contents() == "tiny-qwen2-0 (offspec self draft, Q3_K)"
    requantized = 0
    for s, o in zip(src.tensors, out.tensors):
        assert list(o.shape) == list(s.shape), s.name
        if _is_block_weight(s.name):
            assert o.tensor_type == gguf.GGMLQuantizationType.Q3_K, s.name
            want = gguf.dequantize(s.data, s.tensor_type)  # (rows, cols) float32
            got = gguf.dequantize(o.data, o.tensor_type)  # (rows, cols) float32
            assert np.sqrt(((got - want) ** 2).mean()) < 0.25 * np.sqrt((want ** 2).mean()), s.name
            requantized += 1
        else:  # norms, biases, the token table, the LM head: byte for byte
            assert o.tensor_type == s.tensor_type and bytes(o.data) == bytes(s.data), s.name
    assert requantized == 2 * len(BLOCK_WEIGHTS)
    assert events[-1].finished and events[-1].message.startswith("self draft: Q3_K copy of target, ")
    assert events[-1].message.endswith(", built")
    steps = [e for e in events if not e.finished]
    assert [e.done for e in steps] == list(range(len(src.tensors))) and steps[0].total == len(src.tensors)


def test_a_weight_already_at_that_few_bits_is_kept_and_q2_k_is_asked_for_by_name(cache, tmp_path):
    low = save_tiny_gguf(tmp_path / "low.gguf", "llama", types={"linear": "IQ3_XXS"})  # 3.06 bits per weight
    assert self_draft_type(" SELF ") == "Q3_K" and self_draft_type("self:q2_k") == "Q2_K"
    assert self_draft_type("small.gguf") is None and self_draft_type(None) is None
    with pytest.raises(OffspecError, match="self:Q2_K"):
        self_draft_type("self:Q4_K")
    copy, events = _events(low)
    src, out = gguf.GGUFReader(str(low)), gguf.GGUFReader(str(copy))
    for s, o in zip(src.tensors, out.tensors):
        if s.tensor_type == gguf.GGMLQuantizationType.IQ3_XXS:  # below Q3_K's 3.44 bits: kept as it is
            assert o.tensor_type == s.tensor_type and bytes(o.data) == bytes(s.data), s.name
        elif _is_block_weight(s.name):  # the Q6_K ones
            assert o.tensor_type == gguf.GGMLQuantizationType.Q3_K, s.name
    assert "block weights kept at their own type" in events[-1].message
    q2 = self_copy(low, "Q2_K")
    assert q2 != copy and {t.tensor_type.name for t in gguf.GGUFReader(str(q2)).tensors
                           if _is_block_weight(t.name)} == {"Q2_K"}


def test_the_second_call_takes_the_cached_copy_and_a_changed_target_gets_a_new_one(cache, target, monkeypatch):
    copy, _ = _events(target)
    mtime, real = copy.stat().st_mtime_ns, kquant.quantize_k

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the copy was built again")

    monkeypatch.setattr(kquant, "quantize_k", no_rebuild)
    again, events = _events(target)
    assert again == copy and copy.stat().st_mtime_ns == mtime
    assert events == [events[-1]] and events[-1].finished and events[-1].message.endswith(", cached")
    monkeypatch.setattr(kquant, "quantize_k", real)
    os.utime(target, ns=(mtime + 10**9, mtime + 10**9))  # the target changed: its copy is built again
    newer, events = _events(target)
    assert newer != copy and newer.is_file() and events[-1].message.endswith(", built")
    assert not copy.exists() and sorted(p.name for p in newer.parent.iterdir()) == [newer.name, newer.name + ".built"]


def test_an_interrupted_build_leaves_the_cache_as_it_was_and_a_later_one_succeeds(cache, target, monkeypatch):
    real, calls = kquant.quantize_k, []

    def interrupted(values, type_name, importance=None):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(values, type_name, importance)

    monkeypatch.setattr(kquant, "quantize_k", interrupted)
    with pytest.raises(KeyboardInterrupt):
        self_copy(target)
    assert list((cache / "self").iterdir()) == []  # no copy, no marker, no temp
    monkeypatch.setattr(kquant, "quantize_k", real)
    copy = self_copy(target)
    assert copy == copy_path(target, "Q3_K") and gguf.GGUFReader(str(copy)).tensors
    # a build that fails on a tensor it cannot requantize says so in one line, and leaves nothing either
    monkeypatch.setattr(self_draft, "FORMAT_VERSION", 99)  # another copy name
    monkeypatch.setattr(kquant, "quantize_k", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad values")))
    with pytest.raises(OffspecError, match=r"cannot requantize blk\.0\.attn_q\.weight") as info:
        self_copy(target)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in (cache / "self").iterdir()) == [copy.name, copy.name + ".built"]


def test_greedy_with_draft_self_is_the_targets_own_output(cache, target):
    gen = offspec.load(str(target), "self", budget=16, **LOAD)
    assert "(self Q3_K)" in gen.info.draft and (cache / "self").is_dir()
    alone = offspec.load(str(target), "none", budget=4, **LOAD).generate(PROMPT, max_new_tokens=24, speculate=False)
    assert gen.generate(PROMPT, max_new_tokens=24, speculate=False).token_ids == alone.token_ids
    accepted = 0
    for nodes in (1, 16):
        result = gen.generate(PROMPT, max_new_tokens=24, budget=nodes, drafter="model")
        assert result.token_ids == alone.token_ids, nodes
        accepted += sum(p.accepted for p in result.passes)
    assert accepted > 0  # the copy agrees with its target often enough to be accepted


def _minimal_device_mem(target, draft, **options) -> str:
    """The smallest --device-mem the pair loads under (the loader says it when given too little): the target streams."""
    import re

    with pytest.raises(OffspecError) as info:
        offspec.load(None if target is None else str(target), draft, device_mem="1KB", **options)
    return re.search(r"--device-mem (\S+)", str(info.value))[1]


def _deep_target(tmp_path):
    # 16 layers: streaming pays for its 4 slots of a layer each only where the layers' bytes less their copies'
    # exceed them (a tiny model's budget is mostly the runtime's)
    return save_tiny_gguf(tmp_path / "deep.gguf", "qwen2", seed=0, hidden=256, inter=512, layers=16)


def _streaming_budgets(target, options: dict) -> dict[int, int]:
    """{resident layers: a --device-mem that places that many with the rest streamed} for a self draft of `target`,
    as the placement (a pure function of the sizes a load reports) gives them near the smallest budget. The
    process's measured memory must be held fixed (`fixed_runtime`) for a later load to place the same."""
    import dataclasses

    from offspec.offload.config import CPU_HEADROOM, OffloadConfig
    from offspec.offload.placement import ModelSizes, plan_placement

    minimal = parse_size(_minimal_device_mem(target, "self", **options))
    placed = offspec.load(str(target), "self", device_mem=str(minimal), **options).info.extra["placement"]
    sizes = ModelSizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in placed["sizes"].items()})
    found = {}
    for budget in range(minimal - 8 * 2**20, minimal + 8 * 2**20, 40_000):
        try:
            p = plan_placement(dataclasses.replace(sizes, headroom_bytes=int(budget * CPU_HEADROOM)),
                               torch.device("cpu"), OffloadConfig(device_mem=budget, ram_mem=0))
        except OffspecError:
            continue
        if p.streams:
            found.setdefault(p.count("device"), budget)
    return found


@pytest.fixture
def fixed_runtime(monkeypatch):
    """The process's measured memory held fixed, so that every load's budget arithmetic is the same."""
    monkeypatch.setattr("offspec.offload.model.measured_runtime", lambda: 300 * 2**20)


@pytest.mark.parametrize("placement", ["resident", pytest.param("streamed", marks=pytest.mark.slow)])
def test_self_is_the_targets_greedy_output_at_budgets_16_and_256(cache, tmp_path, placement, fixed_runtime):
    target = _deep_target(tmp_path)
    options = dict(max_context=512, max_budget=256)
    if placement == "streamed":  # every layer streamed: the draft is its copies alone
        options["offload_dir"] = str(tmp_path / "off")
        options["device_mem"] = str(_streaming_budgets(target, options)[0])
    gen = offspec.load(str(target), "self", **options)
    placed = gen.info.extra["placement"]
    assert (placed["layers"]["ssd"] == 16) == (placement == "streamed") and placed["shared_layers"] == 0
    alone = offspec.load(str(target), "none", max_context=512, max_budget=64).generate(
        PROMPT, max_new_tokens=40, speculate=False)
    for nodes in (16, 256):
        result = gen.generate(PROMPT, max_new_tokens=40, budget=nodes, drafter="model")
        assert result.token_ids == alone.token_ids, (placement, nodes)
        assert max(p.tree_size for p in result.passes) >= min(nodes, 2)


@pytest.mark.slow
def test_a_streamed_target_lends_its_resident_layers_to_the_self_draft(cache, tmp_path, fixed_runtime):
    target = _deep_target(tmp_path)
    options = dict(max_context=512, max_budget=256, offload_dir=str(tmp_path / "off"))
    alone = offspec.load(str(target), "none", max_context=512, max_budget=64).generate(
        PROMPT, max_new_tokens=40, speculate=False)
    some = {count: budget for count, budget in _streaming_budgets(target, options).items() if count}
    assert len(some) >= 2, some
    for count, budget in sorted(some.items())[:2]:
        gen = offspec.load(str(target), "self", device_mem=str(budget), **options)
        placed = gen.info.extra["placement"]
        resident = [i for i, t in enumerate(placed["tiers"]) if t == "device"]
        drafts = gen.engine.drafter.model.runner.model.get_decoder().layers
        targets = gen.engine.target.model.get_decoder().layers
        assert len(resident) == count and placed["layers"]["ssd"] == 16 - count
        assert [i for i in range(16) if drafts[i] is targets[i]] == resident  # the target's own modules
        assert placed["shared_layers"] == count and placed["device_bytes"] <= budget
        for nodes in (16, 256):
            result = gen.generate(PROMPT, max_new_tokens=40, budget=nodes, drafter="model")
            assert result.token_ids == alone.token_ids, (resident, nodes)


@pytest.mark.integration
def test_self_on_the_real_target_is_its_greedy_output_resident_and_streamed(tmp_path):
    """The default target's own Q3_K copy (built once into the cache: minutes) as its draft."""
    prompt = "Write a Python function that checks whether a number is prime."
    options = dict(max_context=512, max_budget=256)
    alone = offspec.load(draft="none", **options).generate(prompt, max_new_tokens=16, speculate=False)
    resident = offspec.load(draft="self", **options)
    for nodes in (16, 256):
        assert resident.generate(prompt, max_new_tokens=16, budget=nodes, drafter="model").token_ids == alone.token_ids
    del resident
    budget = _minimal_device_mem(None, "self", **options)
    streamed = offspec.load(draft="self", device_mem=budget, offload_dir=str(tmp_path), **options)
    assert streamed.info.extra["placement"]["layers"]["ssd"] >= 1
    for nodes in (16, 256):
        out = streamed.generate(prompt, max_new_tokens=16, budget=nodes, drafter="model")
        assert out.token_ids == alone.token_ids, nodes
        assert out.tokens_per_pass > 1.0


def test_a_target_that_is_not_a_gguf_or_self_as_a_target_is_one_line(cache, tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", arch="qwen2")
    with pytest.raises(OffspecError, match="--draft self needs a GGUF target for now") as info:
        offspec.load(str(hf_dir), "self", **LOAD)
    assert "\n" not in str(info.value) and "--draft none" in str(info.value)
    with pytest.raises(OffspecError, match="use --draft self"):
        offspec.load("self", "none", **LOAD)
    assert not (cache / "self").exists()
