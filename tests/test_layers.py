"""Whole decoder layers in one compiled call (offspec/formats/layers.py, csrc/layer.h) and a resident pass's layers
all in one (layer_stack.py): what they compute, that a runner's passes use them, that every row is computed from its
own tokens alone, and where they do not apply.

Tier 2: tiny random GGUFs (tests/helpers/tiny_gguf.py); losslessness on them is tests/test_gguf_store.py's, whose pairs run
the compiled layers too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from helpers.tiny_gguf import save_tiny_gguf

import offspec
from offspec.formats import kernels, layer_stack
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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_a_resident_pass_runs_its_layers_in_one_call_with_the_same_bits(cache, tmp_path, monkeypatch, arch):
    """The plain families (their model's forward: embed, rotary, layers, norm) run a resident pass's layers in one
    compiled call (layer_stack.stack_forward, csrc/layer_stack.h); gemma's forward does more, so it keeps the model's
    loop. Either way the bits are those of the layers called one by one."""
    runner = _target(save_tiny_gguf(tmp_path / f"{arch}.gguf", arch, seed=4, layers=3))
    assert runner.io is None  # resident
    stacked = _causal(runner, PROMPT, [4, 1, 8])
    assert hasattr(runner.body, "_offspec_stack") == (arch not in ("gemma2", "gemma3"))
    if hasattr(runner.body, "_offspec_stack"):  # the embedding (ggml rows) and the final norm in the same call
        assert runner.body._offspec_stack.watched and runner.body._offspec_stack.body
    monkeypatch.setattr(layer_stack, "USE_STACK", False)
    assert torch.equal(_causal(runner, PROMPT, [4, 1, 8]), stacked)
    assert torch.equal(_causal(runner, PROMPT, [len(PROMPT)]), stacked)


def test_a_layer_with_hooks_keeps_the_models_loop(cache, ggufs):
    """Streaming binds a layer's weights in its forward hooks: a body with any layer hook never runs the stack."""
    runner = _target(ggufs["llama"])
    runner.body.__dict__.pop("_offspec_stack", None)  # built by the warm-up passes of `load`
    calls = []
    hook = runner.model.model.layers[2].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        _causal(runner, PROMPT, [len(PROMPT)])
        assert calls == [1] and not hasattr(runner.body, "_offspec_stack")
    finally:
        hook.remove()
    _causal(runner, PROMPT, [len(PROMPT)])
    assert calls == [1] and hasattr(runner.body, "_offspec_stack")


def test_a_hook_added_after_the_stack_was_built_keeps_the_models_loop(cache, ggufs):
    """The stack's own check sees a layer's hooks too: a hook registered once the stack runs is called."""
    runner = _target(ggufs["llama"])
    _causal(runner, PROMPT, [len(PROMPT)])
    assert runner.body._offspec_stack.watched
    calls = []
    hook = runner.model.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
    try:
        _causal(runner, PROMPT, [len(PROMPT)])
        assert calls == [1]
    finally:
        hook.remove()


@pytest.mark.parametrize("which", ["embedding", "final norm"])
def test_a_rebound_embedding_or_final_norm_rebuilds_the_stack(cache, ggufs, monkeypatch, which):
    """The stack embeds and norms with the tensors it was given; one bound anew is used from the next pass on, as
    the modules themselves would use it."""
    runner = _target(ggufs["llama"])
    whole = _causal(runner, PROMPT, [len(PROMPT)])
    first = runner.body._offspec_stack
    module = runner.body.embed_tokens if which == "embedding" else runner.body.norm
    holder, name = (module._buffers, "qweight") if which == "embedding" else (module._parameters, "weight")
    old = holder[name]
    # another embedding (each token takes the next one's row) or another norm scale
    holder[name] = old.roll(1, 0) if which == "embedding" else nn.Parameter(old.detach() * 2, requires_grad=False)
    try:
        changed = _causal(runner, PROMPT, [len(PROMPT)])
        assert runner.body._offspec_stack is not first and runner.body._offspec_stack.body
        assert not torch.equal(changed, whole)
        monkeypatch.setattr(layer_stack, "USE_STACK", False)  # the modules, layer by layer
        assert torch.equal(_causal(runner, PROMPT, [len(PROMPT)]), changed)
    finally:
        holder[name] = old


def test_a_stack_it_cannot_watch_natively_is_checked_in_python_with_the_same_bits(cache, ggufs, monkeypatch):
    """Where something the stack holds is not in a dict it can watch, the check runs in Python and the modules embed
    and norm: the same bits, and a rebound weight or a hook is still seen."""
    runner = _target(ggufs["qwen2"])
    whole = _causal(runner, PROMPT, [4, 1, 8])
    monkeypatch.setattr(layer_stack, "_watch_list", lambda *_: None)
    runner.body.__dict__.pop("_offspec_stack")
    assert torch.equal(_causal(runner, PROMPT, [4, 1, 8]), whole)
    first = runner.body._offspec_stack
    assert not first.watched and not first.body
    q = runner.model.model.layers[0].self_attn.q_proj
    q._buffers["qweight"] = q._buffers["qweight"].clone()
    assert torch.equal(_causal(runner, PROMPT, [4, 1, 8]), whole)
    assert runner.body._offspec_stack is not first
    calls = []
    hook = runner.model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        _causal(runner, PROMPT, [len(PROMPT)])
        assert calls == [1]
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_the_rotary_table_gives_each_position_the_bits_of_computing_it_alone(cache, tmp_path, monkeypatch, arch):
    """A plain body's pass reads cos and sin from a table its rotary embedding computed once, grown as positions
    come: each row the bits the embedding gives that position alone; a rotary embedding that is not static (its
    frequencies may follow the length) is computed per pass."""
    runner = _target(save_tiny_gguf(tmp_path / f"{arch}.gguf", arch, seed=6, layers=2))
    rotary = runner.body.rotary_emb
    rotary.__dict__.pop("_offspec_rotary", None)
    cos, sin = layer_stack._rotary(rotary, torch.tensor([3, 0, 1023]))
    assert rotary._offspec_rotary[0].shape[0] == 1024
    grown_cos, grown_sin = layer_stack._rotary(rotary, torch.tensor([1024, 3, 0, 1023, 2047]))  # the table doubles
    table_cos, table_sin, _ = rotary._offspec_rotary
    assert table_cos.shape[0] == 2048 and torch.equal(grown_cos[1:4], cos) and torch.equal(grown_sin[1:4], sin)
    for p in range(2048):
        alone_cos, alone_sin = rotary(torch.empty(0), position_ids=torch.tensor([[p]]))  # (1, 1, rotary dims)
        assert torch.equal(table_cos[p], alone_cos[0, 0]) and torch.equal(table_sin[p], alone_sin[0, 0]), p
    monkeypatch.setattr(layer_stack, "_STATIC_ROPES", frozenset())
    rotary.__dict__.pop("_offspec_rotary")
    assert torch.equal(layer_stack._rotary(rotary, torch.tensor([5, 900]))[0], table_cos[[5, 900]])
    assert "_offspec_rotary" not in rotary.__dict__


def test_a_rebound_weight_rebuilds_the_stack(cache, ggufs):
    """The stack holds the tensors and kernel types bound when it was built; a weight bound anew (or laid out
    anew: rows interleaved or back) is seen at the next pass."""
    runner = _target(ggufs["legacy"])
    whole = _causal(runner, PROMPT, [len(PROMPT)])
    first = runner.body._offspec_stack
    q = runner.model.model.layers[1].self_attn.q_proj
    q._buffers["qweight"] = kernels.stored_rows(q).clone()  # row-major again (or a copy, where never interleaved)
    q.interleaved = False
    assert torch.equal(_causal(runner, PROMPT, [len(PROMPT)]), whole)
    assert runner.body._offspec_stack is not first
    layer1 = runner.body._offspec_stack
    assert layer1.tensors[17] is q._buffers["qweight"] and layer1.types[7] == q.type_id  # layer 1's q: row-major


def test_a_weight_laid_out_anew_in_place_rebuilds_the_stack(cache, ggufs):
    """A kernel type that changes while its tensor stays (a draft's products marked on interleaved rows, as
    `kernels.as_draft` does in place) is seen at the next pass too."""
    runner = _target(ggufs["legacy"])
    _causal(runner, PROMPT, [len(PROMPT)])
    first = runner.body._offspec_stack
    q = runner.model.model.layers[1].self_attn.q_proj
    if not q.interleaved:
        pytest.skip("these kernels keep the rows row-major (no AVX2): no interleaved type to mark")
    q.sums = not q.sums
    try:
        _causal(runner, PROMPT, [len(PROMPT)])
        assert runner.body._offspec_stack is not first and runner.body._offspec_stack.types[7] == q.kernel_type
        assert runner.body._offspec_stack.tensors[17] is q._buffers["qweight"]  # the same tensor, another type
    finally:
        q.sums = not q.sums


def test_a_tensor_held_elsewhere_rebuilds_the_stack(cache, ggufs):
    """A tensor that leaves the dict it was held in (its module now holds it some other way) is looked up anew."""
    runner = _target(ggufs["llama"])
    whole = _causal(runner, PROMPT, [len(PROMPT)])
    first = runner.body._offspec_stack
    norm = runner.model.model.layers[0].input_layernorm
    weight = norm._parameters.pop("weight")
    norm.__dict__["weight"] = weight  # the same tensor, a plain attribute now
    try:
        assert torch.equal(_causal(runner, PROMPT, [len(PROMPT)]), whole)
        assert runner.body._offspec_stack is not first
    finally:
        del norm.__dict__["weight"]
        norm._parameters["weight"] = weight


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
