"""Whole decoder layers in one compiled call (offspec/formats/layers.py, csrc/layer.h): what they compute, that a
runner's passes use them, that every row is computed from its own tokens alone, and where they do not apply.

Tier 2: tiny random GGUFs (tests/helpers/tiny_gguf.py); losslessness on them is tests/test_gguf_store.py's, whose pairs run
the compiled layers too."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_gguf import save_tiny_gguf

import offspec
from offspec.formats import kernels
from offspec.formats.layers import install, unsupported
from offspec.formats.modules import QLinear
from offspec.spec.runner import COMPILED_MAX_TOKENS

LOAD = dict(max_context=256, max_budget=64)
PROMPT = [5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7, 18, 64]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layer-ggufs")
    return {"qwen2": save_tiny_gguf(root / "qwen2.gguf", "qwen2", seed=0, layers=3),  # q, k, v biases
            "llama": save_tiny_gguf(root / "llama.gguf", "llama", seed=1, layers=3),
            "legacy": save_tiny_gguf(root / "legacy.gguf", "qwen2", seed=3, types={
                "linear": "Q5_0", "down": "Q4_1", "v": "Q8_0", "embed": "Q5_1", "output": "Q4_0"})}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))


def _target(path):
    runner = offspec.load(str(path), str(path), budget=4, **LOAD).engine.target
    assert runner.layers_unsupported is None  # the tiny models are llama-family with ggml blocks: compiled
    return runner


def _causal(runner, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Hidden states (len(tokens), hidden) of `tokens` run causally from an empty cache, in passes of `chunks`."""
    runner.cache.truncate(0)
    out, start = [], 0
    for size in chunks:
        part = tokens[start : start + size]
        pos = torch.arange(start, start + size)  # (size,)
        visible = torch.ones((size, start + size), dtype=torch.bool)  # (size, start+size)
        visible[:, start:] = torch.ones((size, size), dtype=torch.bool).tril()
        out.append(runner.forward(torch.tensor(part), pos, pos, visible))
        runner.cache.keep(torch.empty(0, dtype=torch.long), start + size)
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("name", ["qwen2", "llama", "legacy"])
def test_a_compiled_layer_computes_what_transformers_computes(cache, ggufs, name):
    runner = _target(ggufs[name])
    got = _causal(runner, PROMPT, [len(PROMPT)])
    runner.layers_unsupported = "off for the test"  # transformers' layers (with the same exact attention)
    want = _causal(runner, PROMPT, [len(PROMPT)])
    # the same operations; a last bit of difference in a norm may move an 8-bit activation rounding, no more
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert not torch.equal(got, torch.zeros_like(got))


def test_a_runners_pass_runs_the_compiled_layers_and_other_calls_run_transformers(cache, ggufs):
    runner = _target(ggufs["qwen2"])
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in runner.model.modules()
             if isinstance(m, QLinear)]
    try:
        _causal(runner, PROMPT, [len(PROMPT)])
        assert calls == []  # no projection module ran: the layers ran compiled
        with torch.no_grad():
            runner.model(torch.tensor([PROMPT]))  # not a runner's pass: transformers' forward, module by module
        assert len(calls) == 7 * 3 + 1  # every projection of the 3 layers, and the LM head
    finally:
        for h in hooks:
            h.remove()


def test_a_draft_runs_its_long_passes_on_transformers_layers(cache, ggufs):
    runner = offspec.load(str(ggufs["llama"]), str(ggufs["llama"]), budget=4, **LOAD).engine.drafter.runner
    assert runner.layers_unsupported is None and not runner.exact
    calls = []
    hook = runner.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
    try:
        tokens = (PROMPT * 10)[:COMPILED_MAX_TOKENS + 1]
        _causal(runner, tokens, [COMPILED_MAX_TOKENS])
        assert calls == []
        _causal(runner, tokens, [COMPILED_MAX_TOKENS + 1])  # a catch-up longer than a tree step: SDPA's layers
        assert calls == [1]
    finally:
        hook.remove()


@pytest.mark.parametrize("name", ["qwen2", "legacy"])
def test_each_row_is_the_same_bits_whatever_the_pass(cache, ggufs, name):
    """One pass of 13 tokens, passes of 1, and passes of 4, 1, 8 tokens: bitwise the same hidden states (what makes
    a tree pass verify exactly what the target alone computes)."""
    runner = _target(ggufs[name])
    whole = _causal(runner, PROMPT, [len(PROMPT)])
    assert torch.equal(_causal(runner, PROMPT, [1] * len(PROMPT)), whole)
    assert torch.equal(_causal(runner, PROMPT, [4, 1, 8]), whole)


def test_a_row_ignores_the_keys_it_may_not_see(cache, ggufs):
    """Siblings in one pass (the same position, a tree's two branches) each attend to the prefix alone."""
    runner = _target(ggufs["llama"])
    prefix = _causal(runner, PROMPT[:6], [6])
    assert prefix.shape[0] == 6
    visible = torch.ones((2, 8), dtype=torch.bool)  # (2, 8): two siblings at position 6, each sees itself
    visible[0, 7] = visible[1, 6] = False
    both = runner.forward(torch.tensor([40, 41]), torch.tensor([6, 6]), torch.tensor([6, 7]), visible)
    alone = runner.forward(torch.tensor([41]), torch.tensor([6]), torch.tensor([6]),
                           torch.ones((1, 7), dtype=torch.bool))
    assert torch.equal(both[1], alone[0])


def test_models_the_compiled_layers_do_not_cover_say_why(tiny_dirs):
    target, _ = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(target), max_context=64, max_budget=8)  # float weights: nn.Linear
    assert "not ggml blocks" in gen.engine.target.layers_unsupported
    model = gen.engine.target.model
    assert install(model, torch.device("cpu"), torch.bfloat16) == "compiled layers run on a CPU in float32"
    model.config.hidden_act = "gelu"
    assert "gelu" in unsupported(model)
    model.config.hidden_act = "silu"
    model.config.sliding_window = 4096  # a window is no reason: the runner's mask holds it (tests/test_families.py)
    assert "not ggml blocks" in unsupported(model)


def test_without_the_compiled_kernels_the_layers_stay_transformers(cache, ggufs, monkeypatch):
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_failure", "OFFSPEC_KERNELS=torch")
    runner = offspec.load(str(ggufs["llama"]), str(ggufs["llama"]), budget=4, **LOAD).engine.target
    assert "CPU kernels are unavailable" in runner.layers_unsupported


def test_the_switch_keeps_transformers_layers_and_a_bad_value_is_one_line(cache, ggufs, monkeypatch):
    monkeypatch.setenv("OFFSPEC_LAYERS", "transformers")
    gen = offspec.load(str(ggufs["llama"]), str(ggufs["llama"]), budget=4, **LOAD)
    assert gen.engine.target.layers_unsupported == "OFFSPEC_LAYERS=transformers"
    assert gen.info.extra["layers"] == "OFFSPEC_LAYERS=transformers"  # what bench reports record
    monkeypatch.setenv("OFFSPEC_LAYERS", "fast")
    with pytest.raises(offspec.OffspecError, match="OFFSPEC_LAYERS=fast: use transformers"):
        offspec.load(str(ggufs["llama"]), str(ggufs["llama"]), budget=4, **LOAD)
