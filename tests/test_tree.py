"""Tier 1: the tree math and the acceptance walk, with scripted fake models and exact expectations."""

import math

import pytest
import torch
from helpers.fakes import BigramRunner

from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.drafter import TreeDrafter
from offspec.spec.engine import SpeculativeEngine
from offspec.spec.sampling import TokenChooser
from offspec.spec.tree import DraftTree
from offspec.spec.verify import acceptance_walk, best_children, likely_path

# root 0 -> 1 (.6), 2 (.4); 1 -> 3 (.9), 4 (.1); 2 -> 5 (.5), 6 (.5); 3 -> 7 (.5), 8 (.5)
TABLE = {0: {1: .6, 2: .4}, 1: {3: .9, 4: .1}, 2: {5: .5, 6: .5}, 3: {7: .5, 8: .5}, 5: {9: 1.0}}


def edges(tree: DraftTree) -> set[tuple[int, int]]:
    """(parent token, child token) pairs of the tree."""
    toks, pars = tree.tokens[: tree.n].tolist(), tree.parents[: tree.n].tolist()
    return {(toks[p], toks[i]) for i, p in enumerate(pars) if p >= 0}


def grow(budget, max_beams=1, branch=2, max_depth=8, table=TABLE):
    runner = BigramRunner(table)
    drafter = TreeDrafter(runner)
    tree = drafter.propose([0], TreeConfig(budget=budget, max_beams=max_beams, branch=branch, max_depth=max_depth),
                           temperature=0.0)
    return drafter, runner, tree


def test_growth_expands_best_nodes_and_stops_when_nothing_can_enter():
    _, runner, tree = grow(budget=3)
    # after the root: 1 (.6), 2 (.4); expand 1: 3 (.54), 4 (.06); top-3 = {1, 3, 2}; expand 3: 7, 8 (.27)
    # cannot enter; the open node 2 (.4) cannot beat the worst kept node (.4): stop.
    assert edges(tree) == {(0, 1), (1, 3), (0, 2)}
    assert tree.n == 4
    assert sorted(tree.scores[1:4].tolist()) == pytest.approx(sorted([math.log(.6), math.log(.54), math.log(.4)]),
                                                              rel=1e-5)
    expanded_tokens = [c["tokens"] for c in runner.forward_calls if "tokens" in c]
    assert expanded_tokens == [[1], [3]]  # one node per step (max_beams=1), best first


def test_budget_one_is_a_single_node():
    _, _, tree = grow(budget=1)
    assert edges(tree) == {(0, 1)}


def test_batched_expansion_uses_one_forward_per_step():
    _, runner, tree = grow(budget=6, max_beams=4)
    steps = [c for c in runner.forward_calls if "tokens" in c]
    assert steps[0]["tokens"] == [1, 2]  # both children of the root expanded together
    # step 1 scores: 3 (.54), 5 (.2), 6 (.2), 4 (.06); step 2 adds 7, 8 (.27 each) and 9 (.2, ties 5 and 6):
    # the top 6 are 1, 3, 2, 7, 8 and, of the three tied at .2, the oldest: 5.
    assert edges(tree) == {(0, 1), (0, 2), (1, 3), (3, 7), (3, 8), (2, 5)}


def test_max_depth_limits_expansion():
    _, _, tree = grow(budget=50, max_depth=2)
    assert int(tree.depths[: tree.n].max()) == 2


def test_draft_step_positions_slots_and_mask():
    _, runner, tree = grow(budget=3)
    step2 = [c for c in runner.forward_calls if "tokens" in c][1]  # expanding token 3 (depth 2)
    assert step2["positions"] == [0 + 2]  # root position 0, depth 2
    assert step2["slots"] == [2]  # slot 1 went to node "1" in step 1 (committed prefix is slot 0)
    # token 3 sees the committed root (slot 0), its parent "1" (slot 1) and itself (slot 2)
    assert step2["visible"].tolist() == [[True, True, True]]


def test_trim_keeps_a_valid_subtree_on_ties():
    tree = DraftTree(capacity=32)
    tree.reset(0)
    # children with log-prob 0 tie with their parent: stable order must keep the parent first
    tree.add_children(torch.tensor([0]), torch.tensor([[1, 2]]), torch.tensor([[0.0, -1.0]]))
    tree.add_children(torch.tensor([1]), torch.tensor([[3, 4]]), torch.tensor([[0.0, 0.0]]))
    tree.trim(2)
    toks, pars = tree.tokens[: tree.n].tolist(), tree.parents[: tree.n].tolist()
    assert toks == [0, 1, 3]
    assert pars == [-1, 0, 1]
    assert tree.attention_mask().tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_random_growth_is_always_a_valid_tree():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        table = {}
        for tok in range(16):
            p = torch.rand(16, generator=gen) ** 4
            p = p / p.sum()
            table[tok] = {t: float(p[t]) for t in range(16)}
        budget = int(torch.randint(1, 40, (1,), generator=gen))
        _, _, tree = grow(budget=budget, max_beams=int(torch.randint(1, 6, (1,), generator=gen)), branch=3,
                          table=table)
        n = tree.n
        assert 1 <= n - 1 <= budget
        pars = tree.parents[:n].tolist()
        depths = tree.depths[:n].tolist()
        anc = tree.attention_mask()
        for i in range(1, n):
            assert 0 <= pars[i] < i
            assert depths[i] == depths[pars[i]] + 1
            assert tree.scores[i] <= tree.scores[pars[i]] + 1e-6
            expected = anc[pars[i]].clone()
            expected[i] = True
            assert torch.equal(anc[i], expected)


def test_acceptance_walk_follows_matching_children_then_emits_bonus():
    tokens = [0, 1, 2, 3, 4]
    parents = [-1, 0, 0, 1, 3]
    target = {0: 1, 1: 3, 3: 9}  # target picks 1, then 3, then 9 (not in the tree)
    path, bonus = acceptance_walk(tokens, parents, lambda i: target[i])
    assert path == [0, 1, 3] and bonus == 9
    path, bonus = acceptance_walk(tokens, parents, lambda i: 7)  # disagrees at the root
    assert path == [0] and bonus == 7
    path, bonus = acceptance_walk(tokens, parents, lambda i: {0: 1, 1: 3, 3: 4, 4: 5}[i])
    assert path == [0, 1, 3, 4] and bonus == 5  # the whole branch accepted


def test_observe_keeps_processed_accepted_nodes_in_draft_cache():
    drafter, runner, tree = grow(budget=3)
    toks = tree.tokens[: tree.n].tolist()
    path = [0, toks.index(1), toks.index(3)]  # 1 and 3 were expanded (slots 1 and 2)
    drafter.observe(path, n_committed=4)
    assert runner.cache.length == 1 + 2


def test_likely_path_follows_the_best_scored_child():
    best = best_children([-1, 0, 0, 1, 1, 3], [0.0, -0.1, -2.0, -0.5, -0.3, -0.6])
    assert likely_path(0, best, 8) == [0, 1, 4]  # 1 beats 2, then 4 beats 3; 4 has no child
    assert likely_path(0, best, 2) == [0, 1]
    assert likely_path(3, best, 8) == [3, 5]
    assert likely_path(2, best, 8) == [2]


CHAIN = {t: {t + 1: 0.9} for t in range(12)}  # both models continue t with t + 1


def chain_engine(row_invariant: bool, chain=CHAIN):
    target = BigramRunner(chain)
    target.head_is_row_invariant = row_invariant
    engine = SpeculativeEngine(target, TreeDrafter(BigramRunner(chain)), max_context=64, max_budget=16)
    engine.reset_to([9, 0])  # the root is 0
    return engine, target


@pytest.mark.parametrize("row_invariant", [True, False])
def test_the_walk_reads_the_head_for_the_likely_path_at_once_where_rows_are_batch_invariant(row_invariant):
    engine, target = chain_engine(row_invariant)
    chooser = TokenChooser(SamplingConfig(temperature=0.0), torch.device("cpu"))
    config = TreeConfig(budget=6, max_beams=1, branch=2, max_depth=8)
    tokens, stats = engine.speculative_step(config, chooser)
    assert tokens == [1, 2, 3, 4, 5, 6, 7] and stats.accepted == 6  # the whole chain, then the bonus token
    if row_invariant:  # 0.9 a step: the root and 6 nodes are reached with a chance of 0.9^6 = 0.53 or more
        assert target.logits_rows == [list(range(7))]
    else:
        assert target.logits_rows == [[t] for t in range(7)]


def test_an_unlikely_path_is_read_a_few_rows_at_a_time_then_twice_as_many_while_the_walk_goes_on():
    chain = {t: {t + 1: 0.3} for t in range(20)}  # a long chain the draft rates unlikely: 0.3 a step
    engine, target = chain_engine(True, chain)
    chooser = TokenChooser(SamplingConfig(temperature=0.0), torch.device("cpu"))
    config = TreeConfig(budget=13, max_beams=1, branch=1, max_depth=16)
    tokens, stats = engine.speculative_step(config, chooser)
    assert tokens == list(range(1, 15)) and stats.accepted == 13
    assert target.logits_rows == [list(range(4)), list(range(4, 12)), list(range(12, 14))]  # 4, then 8, then the rest
