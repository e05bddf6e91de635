"""What issue 63 found on main: limits given by hand asked for more memory than the defaults, a draft that will not
run was loaded and counted, and an id outside the model's vocabulary reached its embedding (an IndexError).

- `OffloadConfig.smaller_limits`: the prefill reserve and the staging buffers (no option sets either) are lowered
  whatever limits the user gave, so `--max-context 1024 --max-budget 64` never needs more than the defaults lowered
  to the same values;
- `speculate=False` at load (`--no-speculate`): no draft model is loaded, and a call that speculates anyway drafts
  from suffixes;
- a prompt id past the target's vocabulary, from token ids or from a tokenizer that does not match the model, is
  one OffspecError naming the token, before the model sees it; a draft's proposal past it likewise.
"""

from dataclasses import replace

import pytest
import torch

import offspec
from offspec import OffspecError
from offspec.config import LAST_FIT_CONTEXT, MIN_FIT_CONTEXT, MIN_FIT_PREFILL, OffloadConfig


def _floor(config: OffloadConfig) -> OffloadConfig:
    while (smaller := config.smaller_limits()) is not None:
        config = smaller
    return config


def test_explicit_limits_are_lowered_no_less_than_the_defaults():
    defaults = _floor(OffloadConfig(fit_limits=("max_budget", "max_context")))
    given = _floor(OffloadConfig(max_context=1024, max_budget=64))  # both given: fit_limits empty
    assert (given.max_context, given.max_budget) == (1024, 64)  # what the user gave stays
    assert (defaults.max_context, defaults.max_budget) == (LAST_FIT_CONTEXT, 64)
    # the context goes below MIN_FIT_CONTEXT only once the two internal limits are at their least
    at_floor = OffloadConfig(max_context=MIN_FIT_CONTEXT, max_budget=64, fit_limits=("max_context",))
    steps = [at_floor]
    while (smaller := steps[-1].smaller_limits()) is not None:
        steps.append(smaller)
    first_below = next(i for i, c in enumerate(steps) if c.max_context < MIN_FIT_CONTEXT)
    assert steps[first_below - 1].prefill_tokens == MIN_FIT_PREFILL and steps[first_below - 1].staging_buffers == 0
    assert given.prefill_tokens == defaults.prefill_tokens == MIN_FIT_PREFILL
    assert given.staging_buffers == defaults.staging_buffers == 0


def test_a_limit_given_by_hand_is_never_lowered():
    config = OffloadConfig(max_context=2048, fit_limits=("max_budget",))
    assert _floor(config).max_context == 2048


def test_no_speculate_loads_no_draft_model(tiny_dirs):
    target, draft = tiny_dirs[("llama", 0)]
    lines = []
    gen = offspec.load(str(target), str(draft), dtype="float64", max_context=128, max_budget=16, speculate=False,
                       progress=lambda e: lines.append(e.message))
    assert gen.info.draft == "none"
    assert any("no draft model loaded: speculation is off" in line for line in lines)
    plain = gen.generate("Hello", max_new_tokens=8)
    assert all(p.tree_size == 0 for p in plain.passes)  # the target alone
    suffix = gen.generate("Hello", max_new_tokens=8, speculate=True)  # speculation asked anyway: suffix drafts
    assert suffix.token_ids == plain.token_ids


def test_token_ids_past_the_models_vocabulary_are_one_clear_error(tiny_pair):
    vocab = tiny_pair.engine.target.vocab_size
    with pytest.raises(OffspecError, match=rf"token ids must be in \[0, {vocab}\)"):
        tiny_pair.generate([1, 2, vocab], max_new_tokens=2)


def test_a_tokenizer_id_past_the_vocabulary_names_the_token_before_the_model_runs(tiny_pair, monkeypatch):
    vocab = tiny_pair.engine.target.vocab_size
    monkeypatch.setattr(tiny_pair, "encode", lambda *a, **k: [1, vocab + 2, 3])  # a tokenizer of another model
    calls = []
    monkeypatch.setattr(tiny_pair.engine, "reset_to", lambda ids: calls.append(ids))
    with pytest.raises(OffspecError, match=rf"token id {vocab + 2} \(.*\) at position 1 of the prompt, outside the "
                                           rf"model's vocabulary of {vocab} ids"):
        tiny_pair.generate("Hello", max_new_tokens=2)
    assert calls == []  # nothing reached the model


def test_a_draft_proposal_past_the_vocabulary_is_one_clear_error(tiny_pair, monkeypatch):
    engine = tiny_pair.engine
    vocab = engine.target.vocab_size
    propose = engine.drafter.propose

    def bad_propose(*args, **kwargs):
        tree = propose(*args, **kwargs)
        tree.tokens[tree.n - 1] = vocab  # a draft whose head is wider than the target's embedding
        return tree

    monkeypatch.setattr(engine.drafter, "propose", bad_propose)
    scored = []
    monkeypatch.setattr(engine, "score_tree", lambda tree: scored.append(tree))
    with pytest.raises(OffspecError, match=rf"the draft proposed token id {vocab}, outside the target's vocabulary"):
        tiny_pair.generate("Hello", max_new_tokens=4, budget=4, drafter="model")
    assert scored == []
    engine.forget()
