"""Tier 1: the suffix index and the suffix drafter on scripted token text, with exact expectations."""

import math
import random

import pytest
import torch

from offspec.config import SuffixConfig, TreeConfig
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.spec.suffix_index import SEP, SuffixIndex, continuations


def brute_match(text, context, max_match):
    """The reference: the longest suffix of `context` that occurs in `text` followed by a token."""
    for m in range(min(max_match, len(context)), 0, -1):
        found = [j for j in range(m, len(text)) if text[j - m : j] == context[-m:] and text[j] != SEP]
        if found:
            return m, found
    return 0, []


def brute_count(text, positions, path):
    return sum(1 for j in positions if text[j : j + len(path)] == list(path) and SEP not in text[j : j + len(path)])


def paths(cont):
    """Each node's token path from the root."""
    out = []
    for t, p in zip(cont.tokens, cont.parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def test_longest_match_is_found_and_extended_past_the_key():
    index = SuffixIndex(key_length=2)
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    text = [5, 1, 2, 3, 7, 0, 1, 2, 3, 8, 4, 2, 3]
    index.extend(text)
    # "2 3" ends at 4, 9 and 13 (13: the end, nothing follows); "1 2 3" ends at 4 and 9; "5 1 2 3" nowhere else
    match = index.longest_match([0, 1, 2, 3], max_match=8, max_occurrences=10)
    assert (match.length, match.positions) == (4, (9,))  # "0 1 2 3" (4 tokens: longer than the key)
    match = index.longest_match(text, max_match=8, max_occurrences=10)  # the conversation is its own context
    assert (match.length, match.positions) == (2, (4, 9))  # "4 2 3" never occurred before: "2 3", twice
    assert index.longest_match([9, 9], 8, 10).length == 0
    assert index.longest_match([0, 1, 2, 3], max_match=3, max_occurrences=10).length == 3  # capped
    assert index.longest_match(text, 8, max_occurrences=1).positions == (9,)  # the most recent occurrence


def test_continuations_come_in_frequency_order():
    index = SuffixIndex(key_length=3)
    # after "a b": c d (3 times), c e (once), f (twice); the "a b" at the very end is followed by nothing
    a, b, c, d, e, f = 1, 2, 3, 4, 5, 6
    index.extend([a, b, c, d, 0, a, b, f, 0, a, b, c, d, 0, a, b, c, e, 0, a, b, f, 0, a, b, c, d, 0, a, b])
    match = index.longest_match([9, a, b], 8, 100)  # "9" never occurred: the match is "a b"
    assert match.length == 2 and len(match.positions) == 6
    cont = index.continuations(match.positions, budget=4, max_depth=2)
    assert cont.total == 6
    assert paths(cont) == [(c,), (c, d), (f,), (f, 0)]
    assert cont.counts == (4, 3, 2, 2)
    assert cont.parents == (-1, 0, -1, 2)
    cont = index.continuations(match.positions, budget=10, max_depth=1)
    assert paths(cont) == [(c,), (f,)]  # depth 1 only


def test_equal_counts_prefer_the_most_recent_continuation():
    index = SuffixIndex(key_length=2)
    index.extend([1, 7, 0, 1, 8, 0, 1])
    match = index.longest_match([5, 1], 8, 100)  # "1": followed by 7, then by 8
    cont = index.continuations(match.positions, budget=2, max_depth=1)
    assert cont.tokens == (8, 7)


@pytest.mark.parametrize("seed", range(6))
def test_random_text_matches_the_brute_force_reference(seed):
    rng = random.Random(seed)
    index = SuffixIndex(key_length=3)
    text = []
    for _ in range(300):
        t = rng.randrange(4)
        text.append(t)
        index.extend([t])
        if rng.random() < 0.1:  # cut back, as when a conversation is edited
            cut = rng.randrange(len(text) + 1)
            del text[cut:]
            index.truncate(cut)
        context = text if rng.random() < 0.5 else [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        m, found = brute_match(text, context, max_match=6)
        match = index.longest_match(context, max_match=6, max_occurrences=10_000)
        assert (match.length, list(match.positions)) == (m, found)
        if found:
            cont = index.continuations(match.positions, budget=12, max_depth=4)
            for path, count in zip(paths(cont), cont.counts):
                assert count == brute_count(text, found, path)
            assert list(cont.counts) == sorted(cont.counts, reverse=True)  # best first
    assert index.text == text
    assert index.entries() == sum(min(3, i + 1) for i in range(len(text)))  # every k-gram, nothing stale


def test_updates_as_tokens_are_committed():
    drafter = SuffixDrafter(SuffixConfig(key_length=2, max_match=8, global_tokens=0))
    config = TreeConfig(budget=4, max_depth=8, drafter="suffix")
    tokens = [1, 2, 3, 4, 9, 1, 2]
    tree = drafter.propose(tokens, config)
    assert tree.tokens[: tree.n].tolist() == [2, 3, 4, 9, 1]  # root 2, then the copy "3 4 9 1"
    assert tree.parents[: tree.n].tolist() == [-1, 0, 1, 2, 3]
    tokens += [3, 5, 6]  # the target went another way: 3, 5, 6 are committed
    tree = drafter.propose(tokens, config)
    assert drafter.conversation.text == tokens
    assert tree.n == 1  # "... 3 5 6": "6" never occurred before
    tokens += [1, 2, 3]
    tree = drafter.propose(tokens, config)  # "1 2 3" occurred twice: followed by 4 (older) and 5 (newer)
    assert drafter.match.length == 3
    assert tree.tokens[1:3].tolist() == [5, 4]  # equal counts: the most recent first
    assert tree.parents[1:3].tolist() == [0, 0]


def test_scores_are_acceptance_estimates_that_fall_with_depth():
    cfg = SuffixConfig(key_length=2, global_tokens=0, match_half=2.0)
    drafter = SuffixDrafter(cfg)
    tokens = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    tree = drafter.propose(tokens, TreeConfig(budget=8, max_depth=8, drafter="suffix"))
    m = drafter.match.length
    assert m == 3 and len(drafter.match.positions) == 2  # "0 1 2", followed by 3 and by 4
    q = m / (m + 2)  # nothing verified yet: q(m) is its prior
    toks = tree.tokens[: tree.n].tolist()
    # node "3": 1 of 2 occurrences, and the target must go on once: 1/2 * q
    three = toks.index(3)
    assert tree.scores[three].item() == pytest.approx(math.log(0.5 * q), rel=1e-5)
    # node "3 0": the same occurrence goes on, one more step: times q (a flat score let deep candidates of a
    # short match outrank the draft model's nodes in the hybrid)
    pars = tree.parents[: tree.n].tolist()
    three_zero = next(i for i in range(tree.n) if toks[i] == 0 and pars[i] == three)
    assert tree.scores[three_zero].item() == pytest.approx(math.log(0.5 * q * q), rel=1e-5)
    drafter.rates.observe(m, 6, left=False)  # matches of 2-3 tokens went on 6 times: q(3) rises
    tree = drafter.propose(tokens, TreeConfig(budget=8, max_depth=8, drafter="suffix"))
    assert tree.scores[tree.tokens[: tree.n].tolist().index(3)].item() > math.log(0.5 * q)
    for i in range(1, tree.n):
        p = int(tree.parents[i])
        assert int(tree.depths[i]) == int(tree.depths[p]) + 1
        if p > 0:
            assert tree.scores[i] <= tree.scores[p] + 1e-6


def test_depth_grows_with_the_match_length():
    text = list(range(10, 40)) + [0] + list(range(10, 13))  # "10 11 12" was followed by 27 more tokens
    drafter = SuffixDrafter(SuffixConfig(key_length=2, spec_factor=2.0, global_tokens=0))
    tree = drafter.propose(text, TreeConfig(budget=100, max_depth=32, drafter="suffix"))
    assert drafter.match.length == 3 and tree.n - 1 == 6  # at most 2 x 3 tokens deep
    tree = drafter.propose(text, TreeConfig(budget=4, max_depth=32, drafter="suffix"))
    assert tree.n - 1 == 4  # the budget bounds it too
    assert drafter.confident is False  # a 3-token match is not long enough to skip a draft model
    long = list(range(10, 40)) + [0] + list(range(10, 20))
    drafter.propose(long, TreeConfig(budget=4, max_depth=32, drafter="suffix"))
    assert drafter.match.length == 10 and drafter.confident


def test_a_confident_copy_runs_past_the_model_depth_cap():
    """max_depth bounds the draft model's growth; a confident suffix pass may go as deep as its nodes."""
    long = list(range(10, 60)) + [0] + list(range(10, 22))  # a 12-token match, followed once by 38 more
    drafter = SuffixDrafter(SuffixConfig(key_length=2, global_tokens=0))
    tree = drafter.propose(long, TreeConfig(budget=4, max_depth=4, confident_budget=20, drafter="suffix"))
    assert drafter.confident and tree.n - 1 == 20 and int(tree.depths[: tree.n].max()) == 20
    assert tree.tokens[1 : tree.n].tolist() == list(range(22, 42))  # the copy, one chain
    short = list(range(10, 60)) + [0] + list(range(10, 13))  # a 3-token match: not confident, the cap holds
    drafter = SuffixDrafter(SuffixConfig(key_length=2, global_tokens=0))
    tree = drafter.propose(short, TreeConfig(budget=4, max_depth=2, confident_budget=20, drafter="suffix"))
    assert not drafter.confident and int(tree.depths[: tree.n].max()) == 2


def test_the_session_history_holds_earlier_generations():
    drafter = SuffixDrafter(SuffixConfig(key_length=2, global_tokens=100))
    config = TreeConfig(budget=3, max_depth=8, drafter="suffix")
    prompt = [50, 51]
    first = prompt + [7, 8, 9, 10]  # the prompt and what was generated
    drafter.reset([], prompt, 0)
    drafter.propose(first, config)
    drafter.reset(first, [60, 61, 7, 8], 0)  # a new conversation: the last output joins the history
    assert drafter.history.text == [7, 8, 9, 10, SEP]  # the output only, not its prompt
    tree = drafter.propose([60, 61, 7, 8], config)
    assert tree.tokens[1 : tree.n].tolist() == [9, 10]  # copied from the earlier generation
    drafter.forget()
    assert len(drafter.history) == 0 and len(drafter.conversation) == 0
    drafter.use_history(False)
    drafter.reset([1, 2, 3], [4], 0)
    assert drafter.history is None


def test_the_history_index_is_bounded_and_forgets_the_oldest_sequences():
    rng = random.Random(0)
    index = SuffixIndex(key_length=3, max_tokens=50)
    kept = []
    for _ in range(40):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 15))]
        index.add_sequence(seq)
        kept.append(seq + [SEP])
        while sum(map(len, kept)) > 50:
            kept.pop(0)
        assert len(index) <= 50 and index.entries() <= 3 * 50
        text = [t for s in kept for t in s]
        assert index.text == text
        for _ in range(5):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            m, found = brute_match(text, context, max_match=5)
            match = index.longest_match(context, max_match=5, max_occurrences=1000)
            assert (match.length, [j - index.base for j in match.positions]) == (m, found)
    index.add_sequence(list(range(100, 200)))  # longer than the bound: its tail only
    assert index.text == list(range(151, 200)) + [SEP]
    assert index.longest_match([120, 121], 5, 10).length == 0  # evicted text no longer matches


def test_continuations_never_cross_a_separator_or_the_end():
    index = SuffixIndex(key_length=2)
    index.add_sequence([1, 2, 3])
    index.add_sequence([1, 2])
    match = index.longest_match([1, 2], 4, 10)
    assert match.positions == (2,)  # the second "1 2" is followed by SEP: not a continuation
    cont = continuations([(index, j) for j in match.positions], budget=10, max_depth=10)
    assert cont.tokens == (3,)


def test_no_match_gives_a_root_only_tree():
    drafter = SuffixDrafter(SuffixConfig(global_tokens=0))
    tree = drafter.propose([1, 2, 3], TreeConfig(budget=8, drafter="suffix"))
    assert tree.n == 1 and int(tree.tokens[0]) == 3
    assert torch.equal(tree.attention_mask(), torch.ones(1, 1, dtype=torch.bool))
