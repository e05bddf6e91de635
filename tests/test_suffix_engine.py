"""Tier 2: suffix and hybrid drafting on tiny random models, through the real loading path: lossless."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offspec
from offspec import OffspecError
from offspec.config import PassCost, SamplingConfig, TreeConfig
from offspec.spec.runner import ModelRunner
from offspec.spec.sampling import TokenChooser

ROOT = Path(__file__).parent.parent
# the tiny random models fall into loops, so text they wrote before comes back: the suffix index finds it
PROMPTS = ["Hello", "def f(x):\n    return x + x + x + x", "ab ab ab ab ab"]


@pytest.mark.parametrize("seed, arch", [(0, "llama"), pytest.param(0, "qwen2", marks=pytest.mark.slow),
                                        pytest.param(1, "llama", marks=pytest.mark.slow),
                                        pytest.param(1, "qwen2", marks=pytest.mark.slow)])
def test_suffix_and_hybrid_greedy_equal_plain_greedy(tiny_dirs, arch, seed):
    target, draft = tiny_dirs[(arch, seed)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=256, max_budget=512, budget=8)
    assert gen.tree.drafter == "hybrid"  # the default with a draft model
    accepted = {"suffix": 0, "hybrid": 0}
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=40, speculate=False)
        for drafter in ("suffix", "hybrid"):
            for budget in (1, 8, 64, 512):
                spec = gen.generate(prompt, max_new_tokens=40, budget=budget, drafter=drafter)
                assert spec.token_ids == plain.token_ids, (arch, seed, prompt, drafter, budget)
                assert spec.text == plain.text
                # a confident suffix pass may propose up to confident_budget nodes (SuffixDecoding's adaptive length)
                assert all(p.tree_size <= max(budget, gen.tree.confident_budget) for p in spec.passes)
                accepted[drafter] += sum(p.accepted for p in spec.passes)
    assert accepted["suffix"] > 0 and accepted["hybrid"] > 0  # the suffix candidates were really used


@pytest.mark.parametrize("per_node", [0.0, 0.02, 0.3])
def test_suffix_trees_cut_by_the_pass_cost_stay_lossless(tiny_dirs, per_node):
    """Suffix candidates cut to what pays (budget="auto" sets `pass_cost`): greedy output is the target's."""
    target, _ = tiny_dirs[("qwen2", 0)]
    gen = offspec.load(str(target), "none", dtype="float64", max_context=256, max_budget=64, budget=32)
    gen.tree = TreeConfig(budget=32, max_depth=32, drafter="suffix", pass_cost=PassCost(base=0.1, per_node=per_node))
    sizes = []
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=40, speculate=False)
        spec = gen.generate(prompt, max_new_tokens=40)
        assert spec.token_ids == plain.token_ids, (prompt, per_node)
        sizes += [p.tree_size for p in spec.passes]
    if per_node == 0.0:  # free nodes: whole candidate trees, accepted in part
        assert max(sizes) > 8 and sum(gen.engine.drafter.suffix.rates.successes) > 0
    if per_node == 0.3:  # a node costs three plain passes: no candidate can pay (it brings at most one token)
        assert set(sizes) == {0}


def test_passes_record_who_drafted_and_modes_switch_per_call(tiny_pair):
    kinds = {}
    for drafter in ("model", "suffix", "hybrid"):
        result = tiny_pair.generate("ab ab ab ab", max_new_tokens=30, budget=8, drafter=drafter)
        kinds[drafter] = {p.drafter for p in result.passes}
    assert kinds["model"] == {"model"} and kinds["suffix"] == {"suffix"}
    assert kinds["hybrid"] <= {"hybrid", "suffix"}  # "suffix": a confident match skipped the draft model
    with pytest.raises(OffspecError, match="unknown drafter"):
        tiny_pair.generate("x", max_new_tokens=2, drafter="magic")


def test_draft_caches_stay_exact_when_the_model_sits_out_passes(tiny_pair):
    """Hybrid passes where the suffix match skipped the draft model: the model catches up later, exactly."""
    engine = tiny_pair.engine
    engine.forget()
    engine.reset_to(tiny_pair.encode("ab ab ab ab ab ab"))
    chooser = TokenChooser(SamplingConfig(), engine.target.device)
    kinds = []
    for _ in range(12):
        _, stats = engine.speculative_step(TreeConfig(budget=16, max_beams=4, branch=4, drafter="hybrid"), chooser)
        kinds.append(stats.drafter)
    draft = engine.drafter.runner
    fresh = ModelRunner(draft.model, capacity=256)
    fresh.extend(engine.tokens[: draft.length])
    for layer in range(len(draft.cache)):
        torch.testing.assert_close(draft.cache.keys[layer][:, :, : draft.length],
                                   fresh.cache.keys[layer][:, :, : draft.length])
    assert engine.drafter.suffix.conversation.text == engine.tokens[: len(engine.drafter.suffix.conversation)]


def test_the_session_history_speeds_up_a_repeated_request(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    gen = offspec.load(str(target), "none", dtype="float64", max_context=256, max_budget=64, budget=32)
    prompt = "Tell me something."
    first = gen.generate(prompt, max_new_tokens=40)
    gen.generate("Something else entirely.", max_new_tokens=5)  # another conversation in between
    again = gen.generate(prompt, max_new_tokens=40)
    assert again.token_ids == first.token_ids
    assert again.tokens_per_pass > first.tokens_per_pass  # the first answer came back from the history


def test_draft_none_loads_the_target_alone_and_speculates_losslessly(tiny_dirs):
    target, _ = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), "none", dtype="float64", max_context=256, max_budget=64, budget=16)
    assert gen.info.draft == "none" and gen.tree.drafter == "suffix" and gen.engine.drafter.runner is None
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=40, speculate=False)
        spec = gen.generate(prompt, max_new_tokens=40)
        assert spec.token_ids == plain.token_ids
        assert {p.drafter for p in spec.passes} == {"suffix"}
    with pytest.raises(OffspecError, match="needs a draft model") as info:
        gen.generate("x", max_new_tokens=2, drafter="model")
    assert "\n" not in str(info.value)
    with pytest.raises(OffspecError, match="needs a draft model"):
        offspec.load(str(target), "none", drafter="hybrid", max_context=64)


def test_draft_none_with_budget_auto_plans_for_the_suffix_drafter(tiny_dirs):
    target, _ = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), "none", dtype="float64", max_context=256, max_budget=64)
    assert set(gen.policies) == {"suffix"} and gen.policy.plan.best.drafter == "suffix"
    assert gen.info.extra["budget_plan"]["drafter"] == "suffix"
    plain = gen.generate(PROMPTS[2], max_new_tokens=30, speculate=False)
    assert gen.generate(PROMPTS[2], max_new_tokens=30).token_ids == plain.token_ids


def test_auto_plans_each_drafter_and_a_call_uses_its_own_plan(tiny_dirs):
    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=256, max_budget=64)
    assert set(gen.policies) == {"model", "suffix", "hybrid"} and gen.policy is gen.policies["hybrid"]
    assert {m: p.plan.best.drafter for m, p in gen.policies.items()} == {m: m for m in gen.policies}
    # the suffix drafter's plan runs gated passes, whatever its budget: up to confident_budget candidates per
    # pass, cut to what pays (its acceptance curve is an average; the cut sees each match)
    assert gen.policies["suffix"].gated and gen.policies["hybrid"].gated == (not gen.policies["hybrid"].speculates)
    result = gen.generate("ab ab ab", max_new_tokens=12, drafter="suffix")
    assert {p.budget for p in result.passes} == {gen.tree.confident_budget}
    assert gen.policies["suffix"].gated_passes == result.n_passes and gen.policies["hybrid"].gated_passes == 0
    assert "budget_adaptive_suffix" in gen.info.extra


@pytest.mark.slow
def test_cli_draft_none_and_drafter_flags(tiny_dirs, tmp_path):
    target, draft = tiny_dirs[("llama", 0)]
    base = [sys.executable, str(ROOT / "main.py"), "generate", "--target", str(target), "--max-context", "128",
            "--max-new-tokens", "8", "--budget", "4", "--json"]
    run = subprocess.run(base + ["--draft", "none", "ab ab ab"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    run = subprocess.run(base + ["--draft", "none", "--drafter", "model", "ab"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "needs a draft model" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run(base + ["--draft", str(draft), "--chain", "3", "--drafter", "suffix", "ab"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--chain" in run.stderr


def test_the_engines_drafter_offers_everything_the_rest_of_offspec_asks_of_it():
    """`EngineDrafter` names what the generator, API, bench and profile use beyond `Drafter`; the engine's
    `HybridDrafter` has all of it, with a draft model or without."""
    from offspec.spec.drafter import Drafter, EngineDrafter
    from offspec.spec.hybrid import HybridDrafter
    from offspec.spec.suffix_drafter import SuffixDrafter

    members = {n for n in vars(EngineDrafter) if not n.startswith("_")} | {
        n for n in vars(Drafter) if not n.startswith("_")} | set(Drafter.__annotations__)
    assert {"modes", "runner", "check_mode", "remember", "use_history", "propose", "observe", "reset", "forget",
            "kind", "caught_up"} <= members
    drafter = HybridDrafter(None, SuffixDrafter())
    assert all(hasattr(drafter, name) for name in members), members - set(dir(drafter))
    assert drafter.modes == ("suffix",) and drafter.runner is None
    with pytest.raises(OffspecError, match="needs a draft model"):
        drafter.check_mode("model")
