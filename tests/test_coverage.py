"""A tree priced by the experts it touches: the coverage curve, its measurement from routing, the profile's `experts`
section, the planner's and the online policy's pricing, and one measurement on a tiny random mixture."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from offspec import OffspecError
from offspec.profile.adapt import AdaptConfig, AdaptiveBudget
from offspec.profile.coverage import CoverageCurve, ExpertReads, ExpertWindow, coverage_of, expert_reads_of
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.planner import PairCosts, PlannerConfig, plan
from offspec.profile.report import plan_summary
from offspec.profile.routing import distinct_at, experts_section
from offspec.profile.schema import validate
from offspec.types import PassStats

POW2 = tuple(2**i for i in range(9))  # 1 .. 256
SECTION = {"budgets": [0, 4, 16, 64], "distinct": [8.0, 20.0, 40.0, 70.0], "experts_used": 8,
           "experts_per_layer": 128, "layers": 48, "read_as_routed": True, "passes": 12, "miss_rate": 0.5,
           "read_seconds": 0.001}


# -- the curve -------------------------------------------------------------------------------------------------

def test_the_curve_interpolates_in_log_tokens_and_extrapolates_the_last_slope():
    c = coverage_of(SECTION)
    assert c(0) == 8.0 and c(-3) == 8.0 and c(4) == 20.0 and c(64) == 70.0
    # between 4 and 16 nodes (5 and 17 tokens): linear in log2(tokens)
    x = (math.log2(9) - math.log2(5)) / (math.log2(17) - math.log2(5))
    assert c(8) == pytest.approx(20.0 + 20.0 * x)
    slope = 30.0 / (math.log2(65) - math.log2(17))
    assert c(256) == pytest.approx(70.0 + slope * (math.log2(257) - math.log2(65)))
    assert c(10**9) == 128.0  # never more than every expert
    assert c.ratio(4) == pytest.approx(2.5)
    assert c.describe() == "1 token 8, 4 nodes 20.0, 16 nodes 40.0, 64 nodes 70.0"


def test_the_curve_is_made_monotone_and_bounded_and_its_budget_0_is_one_token():
    c = CoverageCurve.of([4, 16, 64], [20.0, 15.0, 500.0], experts_used=8, experts_per_layer=128)
    assert c.budgets == (0, 4, 16, 64) and c.distinct == (8.0, 20.0, 20.0, 128.0)
    one = CoverageCurve.of([0], [8.0], 8, 128)  # one token measured only: every node its own experts
    assert one(0) == 8.0 and one(3) == 32.0 and one(1000) == 128.0
    assert c.scaled(0.5).distinct == (8.0, 14.0, 14.0, 68.0)


@pytest.mark.parametrize("budgets, distinct, used, per_layer, says", [
    ([], [], 8, 128, "non-empty"),
    ([0, 4], [8.0], 8, 128, "same length"),
    ([0, 16, 4], [8, 9, 10], 8, 128, "strictly increasing"),
    ([0, 4], [8, 9], 0, 128, "experts_used 0"),
    ([0, 4], [8, 9], 9, 8, "experts_used 9"),
])
def test_a_bad_curve_is_one_clear_error(budgets, distinct, used, per_layer, says):
    with pytest.raises(OffspecError, match=says):
        CoverageCurve.of(budgets, distinct, used, per_layer)


def test_expert_reads_price_the_distinct_experts_the_cache_misses():
    reads = expert_reads_of(SECTION)
    assert reads.reads(1) == 8 * 48 * 0.5 and reads.seconds(5) == pytest.approx(20 * 48 * 0.5 * 0.001)
    assert expert_reads_of(None) is None and expert_reads_of({**SECTION, "read_as_routed": False}) is None
    assert expert_reads_of({**SECTION, "read_seconds": None}) is None


# -- routing -> coverage ---------------------------------------------------------------------------------------

def test_distinct_experts_of_a_pass_follow_the_node_ranks():
    # 2 layers, a root and 3 nodes routed top-2 of 8; ranks: node 2 first, then node 3, then node 1
    routing = torch.tensor([[[0, 1], [1, 2], [3, 4], [0, 1]],  # layer 0: root, node 1, node 2, node 3
                            [[5, 6], [5, 6], [5, 6], [7, 0]]])  # (2, 4, 2)
    ranks = [-1, 2, 0, 1]
    # layer 0: {0,1} -> +{3,4} -> +{} -> +{2}: 2, 4, 4, 5; layer 1: {5,6} -> +{} -> +{7,0} -> +{}: 2, 2, 4, 4
    assert distinct_at(routing, ranks, [0, 1, 2, 3, 100], 8) == [2.0, 3.0, 4.0, 4.5, 4.5]


def test_the_section_averages_the_passes_and_prices_a_miss_by_the_wait():
    section = experts_section([0, 4], [[2.0, 3.0], [2.0, 5.0]], 2, 8, 3, True, routed=100, hits=75,
                              wait_seconds=0.05)
    assert section["distinct"] == [2.0, 4.0] and section["miss_rate"] == 0.25 and section["read_seconds"] == 0.002
    assert experts_section([0], [[2.0]], 2, 8, 3, True, 10, 10, 0.0)["read_seconds"] is None  # no miss: unknown
    assert coverage_of(section)(4) == 4.0


# -- the profile section -------------------------------------------------------------------------------------

def _profile() -> dict:
    return {"format": "offspec-profile", "version": 1, "kind": "reference", "name": "x", "sources": ["test"],
            "hardware": {"device_type": "cpu", "device_name": "cpu", "host_ram_bytes": 1, "cpu_cores": 1}}


def test_the_experts_section_round_trips_and_an_old_profile_without_it_loads(tmp_path):
    from offspec.profile.store import load_profile, save_profile

    old = _profile()
    path = save_profile({**old, "experts": SECTION}, tmp_path / "p.json")
    assert load_profile(path)["experts"] == SECTION
    assert "experts" not in load_profile(save_profile(old, tmp_path / "old.json"))


@pytest.mark.parametrize("change, says", [
    (dict(distinct=[8.0, 20.0]), "field experts.distinct: needs one value per budget"),
    (dict(budgets=[1, 4, 16, 64]), "field experts.budgets: must start at 0"),
    (dict(experts_used=200), "field experts.experts_used: must be <="),
    (dict(miss_rate=1.5), "field experts.miss_rate: must be <= 1"),
    (dict(read_as_routed="yes"), "field experts.read_as_routed: expected a boolean"),
    (dict(layers=0), "field experts.layers: must be >= 1"),
])
def test_a_damaged_experts_section_is_one_clear_error(change, says):
    with pytest.raises(OffspecError, match=re.escape(says)):
        validate({**_profile(), "experts": {**SECTION, **change}}, "p.json")
    broken = copy.deepcopy(SECTION)
    del broken["distinct"]
    with pytest.raises(OffspecError, match="field experts.distinct is missing"):
        validate({**_profile(), "experts": broken}, "p.json")


# -- the planner -----------------------------------------------------------------------------------------------

def _costs(reads=None) -> PairCosts:
    # a CPU-like target: 0.1 s a pass and 3 ms a token more; a free draft; acceptance saturating at 3 tokens
    return PairCosts(target_pass=CostCurve.of([(1, 0.1), (65, 0.292)]), target_head=0.0,
                     draft_step=CostCurve.of([(1, 0.0)]), expert_reads=reads)


ACCEPTANCE = AcceptanceCurve.of(POW2, [3.0 * (1 - math.exp(-b / 8.0)) for b in POW2])
CONFIG = PlannerConfig(budgets=POW2)


def test_without_experts_and_with_free_reads_the_plan_is_unchanged():
    dense = plan(_costs(), ACCEPTANCE, CONFIG)
    assert dense.no_tree_reason == "" and dense.expert_reads is None and "no_tree_reason" not in dense.summary()
    free = plan(_costs(expert_reads_of({**SECTION, "miss_rate": 0.0})), ACCEPTANCE, CONFIG)  # all cached
    assert free.best == dense.best and free.curve == dense.curve and free.notes == dense.notes
    assert free.autoregressive_tokens_per_second == dense.autoregressive_tokens_per_second
    cheap = plan(_costs(expert_reads_of({**SECTION, "read_seconds": 1e-9})), ACCEPTANCE, CONFIG)
    assert cheap.best.budget == dense.best.budget and cheap.speculates


def test_expensive_expert_reads_leave_no_tree_and_the_plan_says_why():
    reads = expert_reads_of({**SECTION, "read_seconds": 0.002})  # 1 token: 8 * 48 * 0.5 * 2 ms = 0.38 s of reads
    result = plan(_costs(reads), ACCEPTANCE, CONFIG)
    assert not result.speculates and plan(_costs(), ACCEPTANCE, CONFIG).speculates
    assert result.no_tree_reason.startswith("the experts a tree touches cost more than its accepted tokens bring")
    assert f"the best tree ({result.best.budget} node" in result.no_tree_reason
    assert result.summary()["no_tree_reason"] == result.no_tree_reason
    assert any(result.no_tree_reason in note for note in result.notes)
    text = plan_summary(result)
    assert "no tree chosen" in text and "1 token 8, 4 nodes 20.0" in text and "50% missed the cache" in text
    # a tree that would not pay even with free reads: the usual note, no experts reason
    slow = replace(_costs(reads), draft_step=CostCurve.of([(1, 10.0)]))
    assert plan(slow, ACCEPTANCE, CONFIG).no_tree_reason == ""


def test_reads_scale_with_the_targets_time():
    costs = _costs(expert_reads_of(SECTION))
    assert costs.scaled(target=2.0).expert_seconds(5) == pytest.approx(2 * costs.expert_seconds(5))
    assert costs.autoregressive_seconds() == pytest.approx(0.1 + costs.expert_seconds(1))
    assert 1 < plan(_costs(), ACCEPTANCE, CONFIG).best.budget < 256  # an interior optimum the tests above keep


# -- online ----------------------------------------------------------------------------------------------------

def test_the_window_reprices_from_the_passes_routing_and_hits():
    reads = expert_reads_of(SECTION)
    window = ExpertWindow(reads, window=8, min_passes=4, tolerance=0.2)
    # 16-node trees that touch 24 experts per layer (the curve says 40: excess 16 of 32), all of them cached
    moved = [window.observe(16, 24 * 48, 24 * 48) for _ in range(4)]
    assert moved == [False, False, False, True]
    assert window.coverage_scale == pytest.approx(0.5) and window.miss_rate == 0.0
    assert window.reads.coverage(16) == pytest.approx(24.0) and window.reads.seconds(17) == 0.0
    assert not window.observe(0, 0, 0)  # a pass without routed experts (a dense model): nothing


def test_the_policy_replans_when_the_cache_stops_missing():
    reads = expert_reads_of({**SECTION, "read_seconds": 0.002})
    policy = AdaptiveBudget(_costs(reads), ACCEPTANCE, CONFIG, AdaptConfig(min_passes=4), guard=None)
    assert not policy.speculates
    reads = policy.costs.expert_seconds
    cost = policy.pass_cost(4)  # what gated suffix candidates weigh: the reads a pass of their size pays too
    assert cost.base == pytest.approx(0.1 + reads(1)) and cost.measured[-1][1] == pytest.approx(
        policy.costs.target_pass(5) + reads(5) - cost.base)
    for _ in range(4):  # the target alone, every expert now cached
        policy.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0, target_seconds=0.0,
                                 budget=0, experts_routed=8 * 48, expert_hits=8 * 48))
    assert policy.speculates and policy.replans[-1].reason == "experts"
    assert policy.summary()["experts"]["miss_rate"] == 0.0
    dense = AdaptiveBudget(_costs(), ACCEPTANCE, CONFIG, guard=None)
    assert "experts" not in dense.summary() and dense.experts is None


# -- measured on a tiny mixture ---------------------------------------------------------------------------------

def test_the_calibration_passes_of_a_tiny_mixture_read_as_routed_measure_the_curve(tmp_path, monkeypatch):
    import offspec
    from helpers.tiny_gguf import save_tiny_gguf
    from offspec.profile.measure import calibration_prompts, measure_acceptance
    from offspec.util.sizes import parse_size

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = save_tiny_gguf(tmp_path / "t.gguf", "qwen3moe", seed=0, layers=4, head_dim=128)
    draft = save_tiny_gguf(tmp_path / "d.gguf", "qwen3moe", seed=0, layers=4, noise=0.002, head_dim=128)
    load = dict(max_context=256, max_budget=16, budget=4, offload_dir=str(tmp_path / "off"))
    with pytest.raises(OffspecError) as info:  # the smallest --device-mem, for layers streamed whole
        offspec.load(str(target), str(draft), device_mem="1KB", **load)
    budget = parse_size(re.search(r"--device-mem (\S+)", str(info.value))[1], "device_mem") + 3 * 2**20
    gen = offspec.load(str(target), str(draft), device_mem=budget, **load)  # experts read as routed
    try:
        assert gen.engine.target.io.slots < 4 * 8
        run = measure_acceptance(gen, [1, 2, 4, 8], calibration_prompts(2), 2, routing=True)
    finally:
        gen.close()
    section = run.experts
    assert section is not None and section["read_as_routed"] and section["layers"] == 4
    validate({**_profile(), "experts": section}, "measured")
    assert section["budgets"] == [0, 1, 2, 4, 8] and section["experts_per_layer"] == 8
    assert section["distinct"][0] == section["experts_used"] == 2  # one token: its top k
    assert all(a <= b for a, b in zip(section["distinct"], section["distinct"][1:]))
    assert 0.0 <= section["miss_rate"] <= 1.0 and section["passes"] > 0
    assert coverage_of(section).describe().startswith("1 token 2")


def test_the_start_up_estimate_of_a_tiny_mixture_read_as_routed_prices_its_experts(tmp_path, monkeypatch):
    """No profile: `--budget auto`'s start-up estimate verifies a few draft trees and prices the expert reads from
    their coverage, says so in budget_basis, and its adaptive policy re-prices them online."""
    import offspec
    from helpers.tiny_gguf import save_tiny_gguf
    from offspec.util.sizes import parse_size

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))  # no saved profile
    target = save_tiny_gguf(tmp_path / "t.gguf", "qwen3moe", seed=0, layers=4, head_dim=128)
    draft = save_tiny_gguf(tmp_path / "d.gguf", "qwen3moe", seed=0, layers=4, noise=0.002, head_dim=128)
    load = dict(max_context=256, max_budget=64, offload_dir=str(tmp_path / "off"))
    with pytest.raises(OffspecError) as info:
        offspec.load(str(target), str(draft), device_mem="1KB", **load)
    budget = parse_size(re.search(r"--device-mem (\S+)", str(info.value))[1], "device_mem") + 3 * 2**20
    gen = offspec.load(str(target), str(draft), device_mem=budget, budget="auto", **load)
    try:
        extra = gen.info.extra
        assert extra["budget_source"] == "estimate" and "draft trees verified (1 token 2" in extra["budget_basis"]
        assert gen.policy.experts is not None and gen.policy.costs.expert_reads.layers == 4
        assert gen.policy.plan.expert_reads is gen.policy.costs.expert_reads  # the plan priced them
        assert gen.generate([5, 9, 33, 70], max_new_tokens=8).token_ids  # and it runs
    finally:
        gen.close()
