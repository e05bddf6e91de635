"""Tier 1: per-pass tree size by expected gain (offspec/spec/gain.py), the suffix drafter's cut, and the gated
auto policy, on scripted numbers and token text with exact expectations."""

import math

import pytest

from offspec import OffspecError
from offspec.config import PassCost, SuffixConfig, TreeConfig
from offspec.profile.adapt import AdaptConfig, AdaptiveBudget
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.planner import PairCosts, PlannerConfig
from offspec.spec.gain import ContinuationRates, best_prefix
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.types import PassStats

CPU = PassCost(base=1.0, per_node=0.3)  # a compute-bound pass: each node costs 30% of a plain pass
STREAMED = PassCost(base=1.0, per_node=0.0)  # a pass that costs the same at any width


def test_best_prefix_maximizes_expected_tokens_per_second():
    # rates: none 1/1; one 1.9/1.3 = 1.46; two 2.4/1.6 = 1.5; three 2.5/1.9 = 1.32
    assert best_prefix([0.9, 0.5, 0.1], CPU) == 2
    assert best_prefix([0.2, 0.1], CPU) == 0  # 1.2/1.3 < 1: a plain pass is faster
    assert best_prefix([0.9, 0.5, 0.1], STREAMED) == 3  # free nodes: all of them
    assert best_prefix([], CPU) == 0
    # the LM head runs on every position of the acceptance walk (expected tokens, bonus included)
    assert PassCost(base=1.0, per_node=0.3, head=0.5).seconds(2, 1.5) == pytest.approx(1.0 + 0.6 + 0.75)
    assert best_prefix([0.35, 0.2], PassCost(base=1.0, per_node=0.3, head=0.5)) == 1  # 1.35/1.975 > 1/1.5
    # a drafting cost is paid whatever is kept: the plain pass pays it too, so a small tree wins sooner
    assert best_prefix([0.25], CPU, draft_seconds=0.0) == 0 and best_prefix([0.25], CPU, draft_seconds=1.0) == 1


def test_measured_pass_costs_decide_how_many_nodes_pay():
    # tile kernels: a few nodes cost nearly what 7 do (1.0 alone, 1.5 with 3 nodes, 1.6 with 7), more cost 0.05 each
    tiles = PassCost(base=1.0, per_node=0.05, measured=((0, 0.0), (3, 0.5), (7, 0.6), (15, 1.0)))
    assert tiles.nodes_seconds(0) == 0.0 and tiles.nodes_seconds(1) == pytest.approx(0.5 / 3)
    assert tiles.nodes_seconds(5) == pytest.approx(0.55) and tiles.nodes_seconds(31) == pytest.approx(1.8)
    assert tiles.seconds(7, 2.0) == pytest.approx(1.6)
    # candidates of 0.15: a line through 1 and 16 nodes (0.0625 a node) takes any number of them; measured, three
    # do not pay their 0.5 (1.45 / 1.5 < 1) while eight pay their 0.65 (2.2 / 1.65)
    line = PassCost(base=1.0, per_node=1.0 / 16)
    assert best_prefix([0.15] * 8, line) == 8 and best_prefix([0.15] * 8, tiles) == 8
    assert best_prefix([0.15] * 3, line) == 3 and best_prefix([0.15] * 3, tiles) == 0
    with pytest.raises(ValueError, match="increasing nodes from 0"):
        PassCost(base=1.0, per_node=0.1, measured=((1, 0.1), (2, 0.2))).validate()
    with pytest.raises(ValueError, match="increasing nodes from 0"):
        PassCost(base=1.0, per_node=0.1, measured=((0, 0.0), (4, 0.2), (2, 0.3))).validate()


def test_pass_cost_is_validated_where_a_tree_config_carries_it():
    with pytest.raises(ValueError):
        PassCost(base=0.0, per_node=0.1).validate()
    with pytest.raises(OffspecError, match="pass_cost"):
        TreeConfig(pass_cost=PassCost(base=1.0, per_node=-1.0)).validate()
    with pytest.raises(OffspecError, match="pass_cost"):
        TreeConfig(pass_cost=(1.0, 0.3)).validate()
    with pytest.raises(OffspecError, match="pass_cost"):
        TreeConfig(pass_cost=PassCost(base="1", per_node=0.3)).validate()
    assert TreeConfig(pass_cost=CPU).validate().pass_cost == CPU


def test_continuation_rates_start_at_the_prior_and_learn_per_match_length():
    rates = ContinuationRates(half=2.0, prior_weight=4.0, max_length=32)
    assert rates.rate(0) == 0.0
    assert rates.rate(1) == pytest.approx(1 / 3) and rates.rate(8) == pytest.approx(0.8)
    rates.observe(8, accepted=10, left=False)  # a run cut short by the proposal's end: no failure
    assert rates.rate(8) == pytest.approx((10 + 4 * 0.8) / 14)
    assert rates.rate(15) == pytest.approx((10 + 4 * 15 / 17) / 14)  # 8..15 share a bucket
    assert rates.rate(16) == pytest.approx(16 / 18)  # the next bucket is untouched
    rates.observe(2, accepted=0, left=True)  # proposed, and the target took another token at once
    assert rates.rate(3) == pytest.approx((4 * 0.6) / 5) and rates.rate(1) == pytest.approx(1 / 3)
    rates.observe(500, accepted=3, left=True)  # past max_length: the last bucket
    assert rates.successes[-1] == 3 and rates.failures[-1] == 1
    assert rates.summary()["8+"] == [10, 0]


COPY = list(range(100, 140))  # 40 tokens of "code" given in the prompt


def drafter(**kw) -> SuffixDrafter:
    return SuffixDrafter(SuffixConfig(global_tokens=0, **kw))


def copy_context(copied: int) -> list[int]:
    """A prompt holding COPY, then an answer that has copied its first `copied` tokens so far."""
    return [1, 2, 3] + COPY + [4, 5] + COPY[:copied]


def test_a_long_copy_proposes_a_long_chain_and_a_weak_match_proposes_nothing():
    config = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="suffix", pass_cost=CPU)
    d = drafter()
    tree = d.propose(copy_context(16), config)  # a 16-token match of text given once
    chain = tree.tokens[1 : tree.n].tolist()
    assert 4 <= len(chain) <= 24 and chain == COPY[16 : 16 + len(chain)]
    assert tree.parents[1 : tree.n].tolist() == list(range(len(chain)))  # one chain, root first
    # a one-token match that continued three different ways: each candidate is a weak bet on this CPU
    weak = [7, 50, 7, 51, 7, 52, 9, 7]
    assert d.propose(weak, config).n == 1  # root only: the pass costs what the target alone costs
    # the same proposals when every node is free: the whole candidate tree
    free = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="suffix", pass_cost=STREAMED)
    assert drafter().propose(weak, free).n == 12  # three branches, up to 4 deep (4 x match)
    # COPY's last 24 tokens, then what followed it in the prompt: the chain reaches the 32-node budget
    assert drafter().propose(copy_context(16), free).tokens[1:33].tolist() == COPY[16:] + [4, 5] + COPY[:6]
    # without a cost model the budget alone decides, as before
    assert drafter().propose(weak, TreeConfig(budget=32, drafter="suffix")).n == 12


def test_the_chain_grows_as_the_target_keeps_taking_the_copy():
    config = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="suffix", pass_cost=CPU)
    d = drafter()
    before = d.propose(copy_context(16), config).n - 1
    d.observe(list(range(before + 1)), 0)  # all accepted: a censored run, no failure
    assert sum(d.rates.failures) == 0 and d.rates.successes[4] == before  # match 16: bucket 16..31
    for _ in range(3):  # three more passes that took all of it
        n = d.propose(copy_context(16), config).n - 1
        d.observe(list(range(n + 1)), 0)
    assert d.propose(copy_context(16), config).n - 1 > before


def test_a_rejected_proposal_counts_as_a_failure_and_lowers_the_rate():
    config = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="suffix", pass_cost=STREAMED)
    d = drafter()
    d.propose(copy_context(16), config)
    d.observe([0, 1, 2], 0)  # two taken, then the target left the chain (node 2 has a child)
    assert d.rates.successes[4] == 2 and d.rates.failures[4] == 1
    d.observe([0, 1], 0)  # nothing proposed since: nothing learned
    assert d.rates.successes[4] == 2
    d.propose(copy_context(16), config)
    d.observe([0], 0)  # the first candidate rejected
    assert d.rates.failures[4] == 2 and d.rates.rate(16) < 16 / 18


def test_a_tree_the_hybrid_merges_is_not_cut_and_teaches_nothing():
    config = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="hybrid", pass_cost=CPU)
    weak = [7, 50, 7, 51, 7, 52, 9, 7]
    d = drafter()
    assert d.propose(weak, config, alone=False).n == 12 and not d.confident  # the model's tree competes with it
    d.observe([0, 1], 0)
    assert sum(d.rates.successes) == sum(d.rates.failures) == 0
    # a confident match is verified alone even in the hybrid: it is cut
    tree = d.propose(copy_context(16), config, alone=False)
    assert d.confident and 1 < tree.n < 1 + 24


def gated_policy(gate: bool = True) -> AdaptiveBudget:
    """No tree pays on average (the draft step costs two target passes); suffix candidates may be gated."""
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.3), (33, 1.26)]), target_head=0.01,
                      draft_step=CostCurve.of([(1, 0.6)]))
    budgets = (1, 4, 16)
    acceptance = AcceptanceCurve.of(budgets, [0.2, 0.4, 0.5])
    return AdaptiveBudget(costs, acceptance, PlannerConfig(budgets=budgets, drafter="hybrid"), AdaptConfig(),
                          guard=None, gate_suffix=gate)


def test_the_gated_policy_proposes_suffix_candidates_with_the_cost_model():
    policy = gated_policy()
    assert not policy.speculates and policy.gated and policy.use_tree()
    tree = policy.next_tree(TreeConfig())
    assert (tree.drafter, tree.budget, tree.confident_budget, tree.max_depth) == ("suffix", 32, 32, 32)
    assert tree.pass_cost.base == pytest.approx(0.3) and tree.pass_cost.per_node == pytest.approx(0.03)
    assert tree.pass_cost.head == pytest.approx(0.01)
    # the measured target passes (1 and 33 tokens) as the nodes' cost: 32 nodes add 0.96 s
    assert [n for n, _ in tree.pass_cost.measured] == [0, 32]
    assert [s for _, s in tree.pass_cost.measured] == pytest.approx([0.0, 0.96])
    policy.observe(PassStats(tree_size=5, accepted=5, emitted=6, draft_seconds=0.0, target_seconds=0.0, budget=32,
                             drafter="suffix"))
    policy.observe(PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0, target_seconds=0.0, budget=32,
                             drafter="suffix"))  # next_tree was not asked before it: not a gated pass
    assert (policy.gated_passes, policy.gated_trees, policy.gated_accepted) == (1, 1, 5)
    assert policy.passes == 0 and not policy.window  # the plan's acceptance curve is not judged by them
    assert policy.summary()["gated"] == {"passes": 1, "with_tree": 1, "accepted": 5}
    # the model drafter's policy never gates: no tree pays, so no tree
    model = gated_policy(gate=False)
    assert not model.gated and not model.use_tree()


def test_gated_passes_follow_the_target_time_and_replan_on_drift():
    policy = gated_policy()
    for _ in range(policy.config.min_passes + 1):  # the target runs 3x slower than profiled
        tree = policy.next_tree(TreeConfig())
        policy.observe(PassStats(tree_size=2, accepted=1, emitted=2, draft_seconds=0.0, budget=tree.budget,
                                 target_seconds=3 * (0.3 + 2 * 0.03 + 2 * 0.01), drafter="suffix"))
    assert policy.target_time_scale == pytest.approx(3.0)
    assert policy.next_tree(TreeConfig()).pass_cost.base == pytest.approx(0.9)
    assert math.isclose(policy.pass_cost(32).per_node, 0.09)
