"""Tier 3: the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft). Installed by `offspec setup`."""

import gc

import pytest

import offspec


@pytest.fixture(scope="module")
def default_pair():
    generator = offspec.load(max_context=1024, max_budget=64)
    yield generator
    del generator
    gc.collect()


@pytest.mark.integration
def test_default_pair_speculative_greedy_equals_plain_greedy(default_pair):
    assert default_pair.engine.target.head_is_row_invariant  # the walk reads the LM head rows in batches
    # the shipped ranks table knows the pair's tokenizer: the draft's head keeps 65,536 tokens + the special ones
    assert 65536 < default_pair.info.extra["draft_vocab"] < 65536 + 100
    prompt = "Write a Python function that checks whether a number is prime, with a docstring."
    plain = default_pair.generate(prompt, max_new_tokens=64, speculate=False)
    spec = default_pair.generate(prompt, max_new_tokens=64, budget=32)
    assert len(plain.token_ids) == 64
    assert spec.token_ids == plain.token_ids
    assert spec.tokens_per_pass > 1.0
    assert spec.passes[0].tree_size == 32


@pytest.mark.integration
def test_default_pair_multi_turn_reuses_the_cache(default_pair):
    messages = [{"role": "user", "content": "Name one sorting algorithm."}]
    first = default_pair.generate(messages, max_new_tokens=16, budget=16)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another one?"}]
    second = default_pair.generate(messages, max_new_tokens=16, budget=16)
    assert second.reused_prompt_tokens > 20
    assert second.text


CODE_EDIT = ("Rename the variable x to count.\n\n```python\ndef count_vowels(sentence):\n    x = 0\n"
             "    for ch in sentence:\n        if ch.lower() in \"aeiou\":\n            x += 1\n    return x\n```")


@pytest.mark.integration
@pytest.mark.parametrize("drafter", ["suffix", "hybrid"])
def test_default_pair_suffix_and_hybrid_greedy_equal_plain_greedy(default_pair, drafter):
    default_pair.engine.drafter.use_history(False)  # the conversation only: no copying of an earlier reply
    try:
        plain = default_pair.generate(CODE_EDIT, max_new_tokens=64, speculate=False)
        assert len(plain.token_ids) == 64
        for budget in (4, 16):
            spec = default_pair.generate(CODE_EDIT, max_new_tokens=64, budget=budget, drafter=drafter)
            assert spec.token_ids == plain.token_ids, (drafter, budget)
            assert {p.drafter for p in spec.passes} <= {drafter, "suffix"}
            assert spec.tokens_per_pass > 1.5  # the edit copies the code it was given: the suffix index finds it
    finally:
        default_pair.engine.drafter.use_history(True)


@pytest.mark.integration
def test_default_pair_streamed_under_1gb_is_lossless_and_equals_the_resident_target(default_pair):
    """The target mostly streamed from SSD under --device-mem 1GB: the same Q4_K/Q6_K blocks through the same
    kernels as the resident target, so its greedy output is the resident target's, and speculation keeps it."""
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    resident = default_pair.generate(prompt, max_new_tokens=20, speculate=False)
    streamed = offspec.load(device_mem="1GB", budget=16)
    try:
        placement = streamed.info.extra["placement"]
        assert placement["layers"]["ssd"] + placement["layers"]["ram"] >= placement["layers"]["device"]
        assert placement["device_bytes"] <= 1_000_000_000
        plain = streamed.generate(prompt, max_new_tokens=20, speculate=False)
        assert plain.token_ids == resident.token_ids
        spec = streamed.generate(prompt, max_new_tokens=20, budget=16)
        assert spec.token_ids == plain.token_ids
        assert spec.tokens_per_pass > 1.0 and sum(p.bytes_streamed for p in spec.passes) > 0
    finally:
        streamed.close()
        del streamed
        gc.collect()
