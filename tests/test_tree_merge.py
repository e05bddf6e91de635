"""Tier 1: merging a model tree and suffix candidates into one tree, and the hybrid drafter on fakes."""

import math
import random

import pytest
import torch
from helpers.fakes import BigramRunner

from offspec.config import SuffixConfig, TreeConfig
from offspec.spec.drafter import TreeDrafter
from offspec.spec.hybrid import HybridDrafter
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.spec.tree import DraftTree, merge_trees


def make_tree(root, nodes, capacity=64):
    """nodes: [(parent index, token, score)], node i + 1 of the tree (the root is 0)."""
    tree = DraftTree(capacity)
    tree.reset(root)
    if nodes:
        parents, tokens, scores = zip(*nodes)
        tree.add_nodes(torch.tensor(parents), torch.tensor(tokens), torch.tensor(scores))
    return tree


def paths_of(tree):
    """{token path from the root: score} of every non-root node."""
    toks, pars = tree.tokens[: tree.n].tolist(), tree.parents[: tree.n].tolist()
    path = [()]
    for i in range(1, tree.n):
        path.append(path[pars[i]] + (toks[i],))
    return {path[i]: float(tree.scores[i]) for i in range(1, tree.n)}


def check_valid(tree, budget):
    n = tree.n
    toks, pars, depths = tree.tokens[:n].tolist(), tree.parents[:n].tolist(), tree.depths[:n].tolist()
    assert n - 1 <= budget
    assert pars[0] == -1 and depths[0] == 0
    siblings = set()
    for i in range(1, n):
        assert 0 <= pars[i] < i  # parent before child
        assert depths[i] == depths[pars[i]] + 1
        assert (pars[i], toks[i]) not in siblings  # no duplicate siblings
        siblings.add((pars[i], toks[i]))
        assert tree.scores[i] <= tree.scores[pars[i]] + 1e-6 or pars[i] == 0  # non-increasing along paths
        expected = tree.ancestors[pars[i]].clone()
        expected[i] = True
        assert torch.equal(tree.ancestors[i], expected)


def test_add_nodes_takes_parents_from_the_same_call_and_refuses_a_later_parent():
    tree = make_tree(0, [(0, 1, -0.1), (1, 2, -0.2), (0, 3, -0.5), (2, 4, -0.3)])
    assert tree.depths[:5].tolist() == [0, 1, 2, 1, 3]
    assert tree.attention_mask()[4].tolist() == [True, True, True, False, True]
    with pytest.raises(ValueError, match="earlier node"):
        tree.add_nodes(torch.tensor([6]), torch.tensor([9]), torch.tensor([0.0]))


def test_merge_unites_equal_nodes_and_keeps_the_best_under_the_budget():
    # model: 1 (.6) -> 3 (.5); 2 (.3).   suffix: 1 (.9) -> 3 (.8) -> 4 (.7); 5 (.1)
    model = make_tree(0, [(0, 1, math.log(.6)), (1, 3, math.log(.5)), (0, 2, math.log(.3))])
    suffix = make_tree(0, [(0, 1, math.log(.9)), (1, 3, math.log(.8)), (2, 4, math.log(.7)), (0, 5, math.log(.1))])
    out = DraftTree(5)
    source = merge_trees(model, suffix, budget=4, out=out)
    got = paths_of(out)
    assert set(got) == {(1,), (1, 3), (1, 3, 4), (2,)}  # "5" (.1) is the fifth best: trimmed
    assert got[(1,)] == pytest.approx(math.log(.9)) and got[(1, 3)] == pytest.approx(math.log(.8))
    assert got[(2,)] == pytest.approx(math.log(.3))
    toks = out.tokens[: out.n].tolist()
    # each merged node's index in the model's tree (-1: only the suffix proposed it)
    assert [source.tolist()[toks.index(t)] for t in (1, 3, 2, 4)] == [1, 2, 3, -1]
    check_valid(out, 4)


def test_merge_of_a_tree_with_itself_or_with_a_root_only_tree_changes_nothing():
    a = make_tree(7, [(0, 1, -0.1), (1, 2, -0.2), (0, 3, -0.3)])
    for b in (make_tree(7, []), make_tree(7, [(0, 1, -0.1), (1, 2, -0.2), (0, 3, -0.3)])):
        out = DraftTree(8)
        source = merge_trees(a, b, budget=8, out=out)
        assert paths_of(out) == paths_of(a) and source.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="same root"):
        merge_trees(a, make_tree(8, []), 4, DraftTree(8))


def random_tree(rng, root, vocab, n_nodes):
    """A random valid tree: unique siblings, children scoring below their parents."""
    nodes, scores, used = [], [0.0], set()
    for _ in range(n_nodes):
        parent = rng.randrange(len(nodes) + 1)
        token = rng.randrange(vocab)
        if (parent, token) in used:
            continue
        used.add((parent, token))
        score = scores[parent] - rng.choice([0.0, rng.random()])  # ties with the parent happen too
        nodes.append((parent, token, score))
        scores.append(score)
    return make_tree(root, nodes, capacity=len(nodes) + 1)


@pytest.mark.parametrize("seed", range(30))
def test_random_merges_are_valid_trees_of_the_best_union_nodes(seed):
    rng = random.Random(seed)
    a = random_tree(rng, 5, vocab=4, n_nodes=rng.randrange(0, 25))
    b = random_tree(rng, 5, vocab=4, n_nodes=rng.randrange(0, 25))
    union = paths_of(a)
    for path, score in paths_of(b).items():
        union[path] = max(score, union.get(path, -math.inf))
    budget = rng.randrange(1, 30)
    out = DraftTree(budget + 1)
    source = merge_trees(a, b, budget, out)
    check_valid(out, budget)
    got = paths_of(out)
    assert out.n - 1 == min(budget, len(union))
    for path, score in got.items():  # union nodes with the better of their scores
        assert score == pytest.approx(union[path])
    kept_worst = min(got.values(), default=math.inf)
    assert all(score <= kept_worst + 1e-6 for path, score in union.items() if path not in got)  # the best ones
    a_paths = list(paths_of(a))
    toks, pars = out.tokens[: out.n].tolist(), out.parents[: out.n].tolist()
    path = [()]
    for i in range(1, out.n):
        path.append(path[pars[i]] + (toks[i],))
        s = int(source[i])
        assert (s >= 1 and a_paths[s - 1] == path[i]) or (s == -1 and path[i] not in paths_of(a))


TABLE = {0: {1: .6, 2: .4}, 1: {3: .9, 4: .1}, 2: {5: .5, 6: .5}, 3: {7: .5, 8: .5}, 5: {9: 1.0}}


def test_rival_candidates_stop_the_model_growth_early():
    runner = BigramRunner(TABLE)
    config = TreeConfig(budget=3, max_beams=1, branch=2, max_depth=8)
    TreeDrafter(runner).propose([0], config, 0.0)
    alone = len([c for c in runner.forward_calls if "tokens" in c])
    runner = BigramRunner(TABLE)
    rival = torch.tensor([-0.01, -0.02, -0.03])  # three suffix candidates all better than any model node
    TreeDrafter(runner).propose([0], config, 0.0, rival=rival)
    assert alone == 2 and len([c for c in runner.forward_calls if "tokens" in c]) == 0  # nothing to gain


def test_can_improve_counts_the_rivals_against_the_budget():
    tree = make_tree(0, [(0, 1, -1.0), (0, 2, -2.0)])
    frontier = torch.tensor([1])
    assert tree.can_improve(2, frontier) is True  # full, but a child of node 1 (-1) may still beat node 2 (-2)
    assert tree.can_improve(2, torch.tensor([2])) is False  # a child of node 2 cannot
    assert tree.can_improve(3, torch.tensor([2])) is True  # room left
    assert tree.can_improve(3, frontier, rival=torch.tensor([-0.5])) is True  # bar -2: node 1 (-1) beats it
    assert tree.can_improve(3, frontier, rival=torch.tensor([-0.1, -0.2, -0.3])) is False  # bar -0.3


def hybrid(table=TABLE, **suffix):
    runner = BigramRunner(table)
    return HybridDrafter(TreeDrafter(runner), SuffixDrafter(SuffixConfig(key_length=2, global_tokens=0, **suffix))), runner


def test_hybrid_merges_and_maps_the_accepted_path_onto_the_model_tree():
    drafter, runner = hybrid()
    tokens = [4, 5, 0, 1, 11, 12, 4, 5, 0]  # the suffix index saw "4 5 0" followed by "1 11 12"
    tree = drafter.propose(tokens, TreeConfig(budget=6, max_beams=2, branch=2, max_depth=4, drafter="hybrid"), 0.0)
    check_valid(tree, 6)
    got = paths_of(tree)
    assert (1,) in got and (1, 11) in got  # "1" from both, "1 11" from the suffix only
    assert drafter.kind == "hybrid"
    toks, pars = tree.tokens[: tree.n].tolist(), tree.parents[: tree.n].tolist()
    one = next(i for i in range(1, tree.n) if toks[i] == 1 and pars[i] == 0)
    eleven = next(i for i in range(1, tree.n) if toks[i] == 11 and pars[i] == one)
    before = runner.cache.length
    drafter.observe([0, one, eleven], n_committed=len(tokens) + 3)
    assert runner.cache.length == before + 1  # "1" was expanded by the model (kept); "11" is suffix-only


def test_hybrid_skips_the_model_where_the_suffix_match_is_long_and_clear():
    drafter, runner = hybrid(confident_match=4)
    text = [20, 21, 22, 23, 24, 25, 26, 27]
    tokens = text + [0] + text[:5]  # a 5-token match, one occurrence: confident
    calls = len(runner.forward_calls)
    tree = drafter.propose(tokens, TreeConfig(budget=4, max_depth=8, drafter="hybrid"), 0.0)
    assert drafter.kind == "suffix" and len(runner.forward_calls) == calls  # no draft step, no catch-up
    # a confident pass may go past the budget (4) and max_depth (8), up to confident_budget (32):
    # here the end of the text ends it
    assert tree.tokens[1 : tree.n].tolist() == [25, 26, 27, 0, 20, 21, 22, 23, 24]
    tree = drafter.propose(tokens, TreeConfig(budget=4, max_depth=8, drafter="hybrid", confident_budget=0), 0.0)
    assert tree.tokens[1 : tree.n].tolist() == [25, 26, 27, 0]  # confident_budget 0: the budget holds
    drafter.observe([0, 1, 2], n_committed=len(tokens) + 3)  # nothing to keep: the model did not run
    tokens += [25, 26, 9]
    drafter.propose(tokens, TreeConfig(budget=4, max_depth=8, drafter="hybrid"), 0.0)  # "9": no match now
    assert drafter.kind == "hybrid"
    extend = [c["extend"] for c in runner.forward_calls if "extend" in c]
    assert extend[-1] == tokens  # the model caught up on everything at once


def test_modes_without_a_draft_model():
    drafter = HybridDrafter(None, SuffixDrafter(SuffixConfig(global_tokens=0)))
    assert drafter.modes == ("suffix",) and drafter.default_mode == "suffix" and drafter.runner is None
    with pytest.raises(Exception, match="needs a draft model"):
        drafter.propose([1, 2], TreeConfig(budget=2, drafter="hybrid"), 0.0)
    assert drafter.propose([1, 2, 1], TreeConfig(budget=2), 0.0).tokens[1].item() == 2


def test_a_short_matchs_deep_copy_does_not_crowd_out_the_models_likely_nodes():
    # the draft model goes 0 -> 1 -> 2 -> 3 -> 4 with 0.7 at each step; the suffix index saw "7 0" once,
    # followed by "10 11 12 ...": a 2-token match, each further token of which is less and less likely
    chain = {t: {t + 1: 0.7} for t in range(6)}
    drafter, _ = hybrid(chain)
    tokens = [7, 0, 10, 11, 12, 13, 14, 15, 8, 9, 7, 0]
    tree = drafter.propose(tokens, TreeConfig(budget=6, max_beams=2, branch=2, max_depth=8, drafter="hybrid"), 0.0)
    check_valid(tree, 6)
    got = set(paths_of(tree))
    # scores: model 0.7^d; suffix q(2)^d = 0.5^d (the prior of q): 1:.7, 10:.5, 1 2:.49, 1 2 3:.34, 10 11:.25,
    # 1 2 3 4:.24 (a flat score per occurrence, 0.25 at every depth, kept "10 11 12" instead of "1 2 3 4")
    assert got == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (10,), (10, 11)}
