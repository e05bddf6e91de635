"""Tier 2: tiny random real models (Llama, Qwen2) loaded from safetensors through the real loading path."""

import collections

import pytest
import torch
from helpers.sampling import MESSAGES, chi_square, exact_two_token_distribution

import offspec
from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.runner import ModelRunner
from offspec.spec.sampling import TokenChooser

PROMPTS = ["Hello", "def f(x):\n    return", "The quick brown fox"]


@pytest.mark.parametrize("seed, arch", [(0, "qwen2"), pytest.param(0, "llama", marks=pytest.mark.slow),
                                        pytest.param(1, "qwen2", marks=pytest.mark.slow),
                                        pytest.param(1, "llama", marks=pytest.mark.slow)])
def test_speculative_greedy_equals_plain_greedy(tiny_dirs, arch, seed):
    target, draft = tiny_dirs[(arch, seed)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=256, max_budget=512)
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=40, speculate=False)
        assert plain.n_passes == len(plain.token_ids)
        for budget in (1, 8, 64, 512):
            spec = gen.generate(prompt, max_new_tokens=40, budget=budget)
            assert spec.token_ids == plain.token_ids, (arch, seed, prompt, budget)
            assert spec.text == plain.text
            if budget >= 8 and len(plain.token_ids) == 40:
                assert spec.tokens_per_pass > 1.2, (budget, spec.tokens_per_pass)


def test_chain_drafter_is_lossless_too(tiny_pair):
    plain = tiny_pair.generate("Hello", max_new_tokens=30, speculate=False)
    tiny_pair.tree = TreeConfig.chain(5)
    try:
        chain = tiny_pair.generate("Hello", max_new_tokens=30)
    finally:
        tiny_pair.tree = TreeConfig()
    assert chain.token_ids == plain.token_ids
    assert all(p.tree_size <= 5 and max(p.depth_counts, default=0) <= 1 for p in chain.passes)


def test_tree_forward_matches_sequential_forward(tiny_pair):
    """Tree mask and depth-based position ids: every node's logits equal running its path as a sequence."""
    engine = tiny_pair.engine
    prompt = tiny_pair.encode("abc")
    engine.reset_to(prompt)
    tree = engine.drafter.propose(engine.tokens, TreeConfig(budget=40, max_beams=4, branch=3), temperature=0.0)
    hidden, _ = engine.score_tree(tree)
    logits = engine.target.logits(hidden)  # (n, V)
    model = engine.target.model
    toks, pars = tree.tokens[: tree.n].tolist(), tree.parents[: tree.n].tolist()
    assert len(set(tree.depths[: tree.n].tolist())) > 2  # a real tree, several levels
    for i in range(tree.n):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        seq = torch.tensor([prompt + path[::-1]])
        ref = model(seq).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, rtol=1e-9, atol=1e-9)


def test_kv_pruning_keeps_exactly_the_accepted_path(tiny_pair):
    engine = tiny_pair.engine
    engine.reset_to(tiny_pair.encode("The quick"))
    chooser = TokenChooser(SamplingConfig(), engine.target.device)
    for _ in range(4):
        engine.speculative_step(TreeConfig(budget=32, max_beams=4, branch=4), chooser)
    fresh = ModelRunner(engine.target.model, capacity=256)
    fresh.extend(engine.tokens[:-1])
    L = engine.target.length
    assert L == len(engine.tokens) - 1
    for layer in range(len(engine.target.cache)):
        torch.testing.assert_close(engine.target.cache.keys[layer][:, :, :L], fresh.cache.keys[layer][:, :, :L])
        torch.testing.assert_close(engine.target.cache.values[layer][:, :, :L], fresh.cache.values[layer][:, :, :L])
    # the draft cache also holds a correct prefix of the committed tokens
    draft = engine.drafter.runner
    fresh_draft = ModelRunner(draft.model, capacity=256)
    fresh_draft.extend(engine.tokens[: draft.length])
    for layer in range(len(draft.cache)):
        torch.testing.assert_close(draft.cache.keys[layer][:, :, : draft.length],
                                   fresh_draft.cache.keys[layer][:, :, : draft.length])


@pytest.fixture(scope="module")
def unrelated_pair(tiny_dirs):
    """float32 target with an UNRELATED draft (another random model): a lossy verifier would show."""
    return offspec.load(str(tiny_dirs[("llama", 0)][0]), str(tiny_dirs[("llama", 1)][0]), max_context=64)


# None: the target alone; the quick lane keeps one speculating drafter (suffix: its trees cost no draft model)
@pytest.mark.parametrize("drafter", [pytest.param(None, marks=pytest.mark.slow),
                                     pytest.param("model", marks=pytest.mark.slow), "suffix",
                                     pytest.param("hybrid", marks=pytest.mark.slow)])
def test_sampling_follows_the_target_distribution(unrelated_pair, drafter):
    """Chi-square test of the first two sampled tokens against the exact target distribution."""
    gen = unrelated_pair
    sampling = SamplingConfig(temperature=1.5, top_k=3)
    prompt_ids = gen.encode(MESSAGES)
    exact = exact_two_token_distribution(gen, prompt_ids, sampling)
    n = 1200
    counts = collections.Counter()
    tree_nodes = 0
    for seed in range(n):
        res = gen.generate(MESSAGES, max_new_tokens=2, temperature=1.5, top_k=3, seed=seed, budget=16,
                           speculate=drafter is not None, drafter=drafter)
        counts[tuple(res.token_ids)] += 1
        tree_nodes += sum(p.tree_size for p in res.passes)
    assert sum(counts.values()) == n and set(counts) <= set(exact)
    if drafter is not None:
        assert tree_nodes > 0  # real trees were verified
    chi2, bins, p_value = chi_square(counts, exact, n)
    assert bins >= 4
    assert p_value > 0.001, (chi2, bins, counts, exact)


def test_sampling_is_reproducible_with_a_seed(tiny_pair):
    a = tiny_pair.generate("Hello", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    b = tiny_pair.generate("Hello", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


@pytest.mark.slow
def test_budget_4096_builds_a_full_tree_and_stays_lossless(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=128, max_budget=4096)
    # 4 tokens: two or three passes of 4096 nodes (each costs this tiny float64 pair ~20 s; 12 tokens took 294 s)
    plain = gen.generate("Hi", max_new_tokens=4, speculate=False)
    spec = gen.generate("Hi", max_new_tokens=4, budget=4096)
    assert spec.token_ids == plain.token_ids
    assert spec.passes[0].tree_size == 4096
    assert spec.passes[0].budget == 4096


def test_a_kv_cache_costs_memory_only_for_the_slots_written():
    """A cache sized for a long context is zero pages until written: its buffers never cost their full size (a
    heap that calloc had to zero cost a 16-token generate 0.6 GB more in some runs than in others)."""
    import psutil

    from offspec.spec.kvcache import SlotKVCache

    proc = psutil.Process()
    cache = SlotKVCache(num_layers=4, capacity=500_000)  # 4 layers x (1, 2, 500k, 64) float32 x K and V: 2 GB
    before = proc.memory_info().rss
    cache.prepare(torch.arange(3), 3)
    for layer in range(4):
        k, v = cache.update(torch.ones(1, 2, 3, 64), torch.full((1, 2, 3, 64), 2.0), layer)
        assert k.shape == (1, 2, 3, 64) and torch.equal(v, torch.full((1, 2, 3, 64), 2.0))
    assert cache.keys[0].shape == (1, 2, 500_000, 64) and float(cache.keys[0][0, 1, 499_999].abs().sum()) == 0.0
    assert proc.memory_info().rss - before < 64 * 2**20  # a few pages per buffer, not 2 GB
