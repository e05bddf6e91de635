"""The hybrid's per-pass choice (TreeConfig.model_expectation): where the suffix candidates that pay on their own
are expected to make more tokens per second than a pass with the draft model's tree, the model does not run."""

from __future__ import annotations

import pytest
import torch

from offspec.config import PassCost, SuffixConfig, TreeConfig
from offspec.errors import OffspecError
from offspec.spec.hybrid import HybridDrafter
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.spec.tree import DraftTree


class ScriptedModel:
    """A draft model that proposes one node (token 7) and counts its proposals."""

    def __init__(self):
        self.calls, self.caught_up, self.runner = 0, 2, None

    def propose(self, tokens, config, temperature, rival=None, grammar=None, grow=None):
        self.calls += 1
        tree = DraftTree(config.budget + 1)
        tree.reset(tokens[-1])
        tree.add_nodes(torch.tensor([0]), torch.tensor([7]), torch.tensor([-0.2]))
        return tree

    def observe(self, accepted, n_committed):
        pass


COST = PassCost(base=0.07, per_node=0.005, head=0.0)  # a CPU: every node costs
PHRASE = [11, 12, 13, 14, 15]


def drafter() -> tuple[HybridDrafter, ScriptedModel]:
    model = ScriptedModel()
    # confident_match 99: no match here is confident, so the choice is the expectations'
    return HybridDrafter(model, SuffixDrafter(SuffixConfig(confident_match=99))), model


def config(expectation) -> TreeConfig:
    return TreeConfig(budget=1, confident_budget=16, drafter="hybrid", pass_cost=COST, model_expectation=expectation)


def test_a_copy_the_suffix_candidates_expect_more_of_runs_without_the_model():
    hybrid, model = drafter()
    seen = [1] + PHRASE * 6 + [2, 3] + PHRASE[:4]  # the phrase came six times: its next token is clear
    tree = hybrid.propose(seen, config((0.8, 0.02)), 0.0)
    assert model.calls == 0 and hybrid.kind == "suffix" and hybrid.caught_up == 0
    assert tree.n > 2 and tree.tokens[1].item() == 15  # deeper than the budget of 1: the suffix pass's own cut
    assert hybrid.suffix.expected > 1.5


def test_no_match_or_a_cheap_strong_model_runs_the_model():
    hybrid, model = drafter()
    tree = hybrid.propose([1, 2, 3, 4], config((0.8, 0.02)), 0.0)  # nothing seen before: the suffix expects 1 token
    assert model.calls == 1 and hybrid.kind == "hybrid" and hybrid.caught_up == 2
    assert tree.tokens[1].item() == 7
    seen = [1] + PHRASE * 6 + [2, 3] + PHRASE[:4]
    hybrid.propose(seen, config((5.0, 0.0)), 0.0)  # a model expected to take 5 tokens for free wins the same copy
    assert model.calls == 2 and hybrid.kind == "hybrid"


def test_without_an_expectation_every_hybrid_pass_runs_the_model():
    hybrid, model = drafter()
    seen = [1] + PHRASE * 6 + [2, 3] + PHRASE[:4]
    hybrid.propose(seen, config(None), 0.0)
    assert model.calls == 1 and hybrid.kind == "hybrid"


def test_a_malformed_expectation_is_one_clear_error():
    for bad in ((1.0,), 3.0, (float("nan"), 0.02), (-1.0, 0.02)):
        with pytest.raises(OffspecError, match="model_expectation must be"):
            TreeConfig(model_expectation=bad).validate()
    assert TreeConfig(model_expectation=(0.8, 0.02)).validate().model_expectation == (0.8, 0.02)
