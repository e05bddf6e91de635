"""Output constrained by a grammar or a JSON schema (offspec/spec/grammar.py): the masks, the drafters' trees, and
lossless speculation under the mask (greedy token for token, sampling in distribution, log-probabilities equal).

Tiny random models with the byte tokenizer (one token per character): exact expectations on small grammars.
"""

import collections
import json

import pytest
import torch
from helpers.sampling import MESSAGES, chi_square, exact_two_token_distribution
from helpers.tiny import BASE_VOCAB, make_tokenizer

import offspec
from offspec import OffspecError
from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.drafter import TreeDrafter
from offspec.spec.grammar import TokenGrammar, grammar_tokenizer, json_schema_grammar, lark_grammar, unpack
from offspec.spec.suffix_drafter import SuffixDrafter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3},
                                           "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                     "required": ["ok"], "additionalProperties": False}},
          "required": ["name", "n", "tags", "inner"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def ll(tok):
    return grammar_tokenizer(tok, BASE_VOCAB, [tok.eos_token_id])


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def chars(tok, mask):
    return sorted(tok.convert_ids_to_tokens(i) for i in mask.nonzero().flatten().tolist())


def test_masks_follow_the_grammar_and_end_with_the_end_of_sequence_token(tok, ll):
    g = TokenGrammar(ll, lark_grammar('start: ("a" | "b") ("x" | "yz")'), BASE_VOCAB)
    assert chars(tok, g.allowed()) == ["a", "b"]
    g.advance(ids(tok, "a")[0])
    assert chars(tok, g.allowed()) == ["x", "y"]
    g.advance(ids(tok, "y")[0])
    assert chars(tok, g.allowed()) == ["z"] and not g.finished
    g.advance(ids(tok, "z")[0])
    assert g.finished and g.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]
    with pytest.raises(OffspecError, match="refused token"):
        g.advance(ids(tok, "q")[0])


def test_paths_give_the_masks_at_tree_nodes_and_leave_the_state_alone(tok, ll):
    g = TokenGrammar(ll, lark_grammar('start: "ab" ("c" | "de") | "x"'), BASE_VOCAB)
    a, b, c, d, x, q = (ids(tok, s)[0] for s in "abcdxq")
    paths = g.paths()
    masks = paths.allowed_after([[a, b], [], [a], [x], [a, b, d], [q]])  # (6, V)
    assert [chars(tok, m) for m in masks] == [["c", "d"], ["a", "x"], ["b"], ["</s>"], ["e"], []]
    # candidate nodes (parents first, -1: the start state): a forbidden node's descendants are forbidden too
    assert paths.allowed_nodes([a, b, q, c, x, d], [-1, 0, 0, 1, -1, 2]) == [True, True, False, True, True, False]
    assert chars(tok, g.allowed()) == ["a", "x"]  # the chooser's own state did not move


def test_unpack_reads_little_endian_words():
    bits = (1 | 1 << 9 | 1 << 31).to_bytes(4, "little") + (1 << 2).to_bytes(4, "little")
    assert unpack(bits, 40).nonzero().flatten().tolist() == [0, 9, 31, 34]
    assert unpack(bits, 70).shape == (70,)  # a view smaller than the logits: the rest never allowed


def test_bad_schemas_and_grammars_are_one_line_errors(ll):
    with pytest.raises(OffspecError, match="not valid JSON"):
        json_schema_grammar("{not json")
    with pytest.raises(OffspecError, match="must be a JSON object"):
        json_schema_grammar("[1, 2]")
    with pytest.raises(OffspecError, match="grammar cannot be used"):
        TokenGrammar(ll, lark_grammar("start: undefined_rule"), BASE_VOCAB)
    with pytest.raises(OffspecError, match="grammar cannot be used"):
        TokenGrammar(ll, json_schema_grammar({"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
                     BASE_VOCAB)


def test_the_draft_model_proposes_only_tokens_the_grammar_allows(tiny_pair, ll, tok):
    """Every node of a draft tree grown under a grammar spells a path the grammar allows; without the grammar the
    same draft proposes others (so the check can fail)."""
    gen = tiny_pair
    drafter = TreeDrafter(gen.engine.drafter.runner)
    prompt = gen.encode("Hello")
    config = TreeConfig(budget=48, branch=4)
    spec = json_schema_grammar(SCHEMA)

    def forbidden(tree) -> int:
        check = TokenGrammar(ll, spec, BASE_VOCAB).paths()
        n = tree.n
        ok = check.allowed_nodes(tree.tokens[1:n].tolist(), [p - 1 for p in tree.parents[1:n].tolist()])
        return ok.count(False)

    gen.engine.forget()
    tree = drafter.propose(prompt, config, 0.0, grammar=TokenGrammar(ll, spec, BASE_VOCAB).paths())
    assert tree.n == 49 and forbidden(tree) == 0
    assert max(tree.depths[: tree.n].tolist()) > 3  # forced tokens cost the path nothing: the tree runs deep
    gen.engine.forget()
    free = drafter.propose(prompt, config, 0.0)
    assert forbidden(free) > 0


def test_suffix_candidates_the_grammar_forbids_are_left_out(tok, ll):
    text = ids(tok, "abXab") + ids(tok, "cd ab")  # "ab" was followed by "X" and by "c": both candidates
    drafter = SuffixDrafter()
    config = TreeConfig(budget=8, drafter="suffix")
    free = drafter.propose(text, config)
    assert {tok.convert_ids_to_tokens(t) for t in free.tokens[1 : free.n].tolist()} >= {"X", "c"}
    g = TokenGrammar(ll, lark_grammar('start: /[a-z ]+/'), BASE_VOCAB)  # lower-case letters and spaces only
    held = SuffixDrafter().propose(text, config, grammar=g.paths())
    kept = [tok.convert_ids_to_tokens(t) for t in held.tokens[1 : held.n].tolist()]
    assert "c" in kept and "X" not in kept


@pytest.mark.parametrize("drafter", ["model", "suffix", "hybrid"])
def test_greedy_under_a_schema_equals_the_target_alone_under_it(tiny_pair, drafter):
    gen = tiny_pair
    expected = gen.generate("Hello", max_new_tokens=80, speculate=False, json_schema=SCHEMA)
    for budget in (1, 8, 64):
        got = gen.generate("Hello", max_new_tokens=80, budget=budget, drafter=drafter, json_schema=SCHEMA)
        assert got.token_ids == expected.token_ids, (drafter, budget)
    assert got.tokens_per_pass > 1.0
    if expected.stop_reason == "eos":  # a whole value: it parses and follows the schema
        value = json.loads(expected.text)
        assert set(value) == {"name", "n", "tags", "inner"} and isinstance(value["inner"]["ok"], bool)


def test_any_json_object_and_a_lark_grammar(tiny_pair):
    obj = tiny_pair.generate("Hello", max_new_tokens=60, budget=8, json_schema=True)
    assert obj.text.startswith("{")
    digits = tiny_pair.generate("Hello", max_new_tokens=12, budget=8, grammar='start: /[0-9]{3}-[0-9]{4}/')
    assert digits.stop_reason == "eos" and len(digits.text) == 8 and digits.text[3] == "-"
    assert digits.text.replace("-", "").isdigit()
    with pytest.raises(OffspecError, match="either a JSON schema or a grammar"):
        tiny_pair.generate("Hello", json_schema=True, grammar='start: "a"')


def test_log_probabilities_are_the_target_alones_with_or_without_a_tree(tiny_pair):
    gen = tiny_pair
    alone = gen.generate("Hello", max_new_tokens=30, speculate=False, logprobs=3)
    tree = gen.generate("Hello", max_new_tokens=30, budget=16, logprobs=3)
    assert tree.token_ids == alone.token_ids and len(alone.logprobs) == len(alone.token_ids) == 30
    for a, b in zip(alone.logprobs, tree.logprobs):
        assert a.token == b.token and a.logprob == b.logprob and a.top == b.top
        assert len(a.top) == 3 and a.top[0][1] >= a.top[1][1] >= a.top[2][1]
    # the first token's: the log-softmax of the target's own logits after the prompt
    prompt = gen.encode("Hello")
    with torch.no_grad():
        logits = gen.engine.target.model(torch.tensor([prompt])).logits[0, -1]
    logp = torch.log_softmax(logits.double(), -1)
    assert abs(alone.logprobs[0].logprob - float(logp[alone.token_ids[0]])) < 1e-5  # computed in float32
    assert [t for t, _ in alone.logprobs[0].top] == torch.topk(logp, 3).indices.tolist()
    # streamed: each pass's tokens come with theirs
    events = [e for e in gen.stream("Hello", max_new_tokens=30, budget=16, logprobs=0)
              if isinstance(e, offspec.TextDelta) and e.stats is not None]
    assert [lp.token for e in events for lp in e.logprobs] == alone.token_ids


def test_constrained_generation_can_be_followed_by_a_free_one(tiny_pair):
    """The grammar is the call's: the next call on the same generator is unconstrained again (and reuses the
    cache)."""
    free = tiny_pair.generate("Hello", max_new_tokens=20, budget=8)
    tiny_pair.generate("Hello", max_new_tokens=20, budget=8, json_schema=SCHEMA)
    again = tiny_pair.generate("Hello", max_new_tokens=20, budget=8)
    assert again.token_ids == free.token_ids


def _masked_distribution(gen, prompt_ids, sampling, spec):
    """P(t1, t2) of the target alone under the grammar `spec` (its masks from a fresh matcher per prefix)."""
    ll = gen.grammar_tokenizer()
    vocab = gen.engine.target.vocab_size

    def allowed(prefix):
        g = TokenGrammar(ll, spec, vocab)
        for t in prefix:
            g.advance(t)
        return g.allowed()

    return exact_two_token_distribution(gen, prompt_ids, sampling, allowed=allowed)


# the quick lane keeps one speculating drafter (suffix: its trees cost no draft model)
@pytest.mark.parametrize("drafter", [pytest.param("model", marks=pytest.mark.slow), "suffix",
                                     pytest.param("hybrid", marks=pytest.mark.slow)])
def test_sampling_under_a_grammar_follows_the_masked_target_distribution(tiny_dirs, drafter):
    gen = offspec.load(str(tiny_dirs[("llama", 0)][0]), str(tiny_dirs[("llama", 1)][0]), max_context=64)
    spec = '''start: /[A-Ha-e]/ /[a-z0-9 ]/'''  # "He" (the earlier turn's reply) is allowed: suffix trees
    sampling = SamplingConfig(temperature=1.5, top_k=4)
    prompt_ids = gen.encode(MESSAGES)
    exact = _masked_distribution(gen, prompt_ids, sampling, lark_grammar(spec))
    n = 1200
    counts = collections.Counter()
    tree_nodes = 0
    for seed in range(n):
        res = gen.generate(MESSAGES, max_new_tokens=2, temperature=1.5, top_k=4, seed=seed, budget=16,
                           drafter=drafter, grammar=spec)
        counts[tuple(res.token_ids)] += 1
        tree_nodes += sum(p.tree_size for p in res.passes)
    assert sum(counts.values()) == n and set(counts) <= set(exact)
    assert tree_nodes > 0  # real trees were verified
    chi2, bins, p_value = chi_square(counts, exact, n)
    assert bins >= 4
    assert p_value > 0.001, (chi2, bins, counts, exact)
