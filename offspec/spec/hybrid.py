"""The drafter the engine holds: the draft model's tree, suffix candidates, or both merged into one tree.

Each pass's `TreeConfig.drafter` picks the mode:
- "model": SpecExec growth on the draft model (`TreeDrafter`; a draft of another tokenizer: `MappedDrafter`, its
  tree mapped to target tokens through text);
- "suffix": continuations of text already seen (`SuffixDrafter`), no model at all;
- "hybrid": the suffix candidates first (they cost almost nothing), then the draft model grows its tree
  with those candidates competing for the same budget: it stops once no open node can beat the
  `budget`-th best of both, so where the suffix candidates are strong it takes fewer steps. Where the
  match is long and its continuation clear (`SuffixDrafter.confident`), the model is not run at all
  (SuffixDecoding's adaptive speculation). The two trees are merged into one (`merge_trees`: the same
  token at the same place is one node, scored by the better of its two scores) under one budget, and
  the target verifies it in one pass as usual.

Both parts see every conversation change (`reset`), whichever mode runs, so switching modes between
passes or calls is always safe: the draft model catches up on the tokens it has not seen.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

import torch

from offspec.config import DRAFTERS, SuffixConfig, TreeConfig
from offspec.errors import OffspecError

from .drafter import Growth, TreeDrafter
from .grammar import GrammarPaths
from .mapped_drafter import MappedDrafter
from .suffix_drafter import SuffixDrafter
from .tree import DraftTree, merge_trees
from .xvocab import VocabMapping


class HybridDrafter:
    """The engine's drafter (`EngineDrafter`: a `Drafter` with modes and a session history)."""

    def __init__(self, model: Union[TreeDrafter, MappedDrafter, None], suffix: SuffixDrafter):
        self.model, self.suffix = model, suffix
        self.kind = "hybrid"  # what built the last tree: "model", "suffix" or "hybrid"
        self.caught_up = 0  # tokens the draft model caught up on in the last proposal (0: it did not run)
        self._ran_model = False
        self._source: Optional[list[int]] = None  # merged node -> node of the model's tree (-1: suffix only)
        self._out: Optional[DraftTree] = None

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this drafter can run: all three with a draft model, else suffix only."""
        return DRAFTERS if self.model is not None else ("suffix",)

    @property
    def default_mode(self) -> str:
        return "hybrid" if self.model is not None else "suffix"

    @property
    def runner(self):
        """The draft model's runner (None without a draft model)."""
        return self.model.runner if self.model is not None else None

    def check_mode(self, mode: Optional[str]) -> str:
        mode = mode or self.default_mode
        if mode not in self.modes:
            raise OffspecError(f"drafter {mode!r} needs a draft model, and none is loaded (--draft none); "
                               f"use drafter suffix, or load a draft model")
        return mode

    # --- the Drafter interface -------------------------------------------------------------------
    def propose(self, tokens: list[int], config: TreeConfig, temperature: float,
                grammar: Optional[GrammarPaths] = None, grow: Optional[Growth] = None) -> DraftTree:
        """`grow` goes to the draft model (a suffix-only tree never grows: it costs nothing to make)."""
        mode = self.check_mode(config.drafter)
        self._source, self.caught_up = None, 0
        if mode == "model":
            self.kind, self._ran_model = "model", True
            tree = self.model.propose(tokens, config, temperature, grammar=grammar, grow=grow)
            self.caught_up = self.model.caught_up
            return tree
        if mode == "hybrid" and config.pass_cost is not None and config.model_expectation is not None:
            alone = self._suffix_alone(tokens, config, temperature, grammar)
            if alone is not None:
                self.kind, self._ran_model = "suffix", False
                return alone
            suffix_tree = self.suffix.propose(tokens, config, temperature, alone=False,  # the candidates to merge
                                              grammar=grammar)
        else:
            suffix_tree = self.suffix.propose(tokens, config, temperature, alone=mode == "suffix", grammar=grammar)
            if mode == "suffix" or self.suffix.confident:
                self.kind, self._ran_model = "suffix", False
                return suffix_tree
        rival = suffix_tree.scores[1 : suffix_tree.n]  # (r,) the suffix candidates' scores
        model_tree = self.model.propose(tokens, config, temperature, rival=rival, grammar=grammar, grow=grow)
        self.caught_up = self.model.caught_up
        budget = max(config.budget, model_tree.n - 1)  # more where the model's tree grew while the weights load
        out = self._out_for(budget)
        self._source = merge_trees(model_tree, suffix_tree, budget, out).tolist()  # sync: observe() reads it
        self.kind, self._ran_model = "hybrid", True
        return out

    def observe(self, accepted: list[int], n_committed: int) -> None:
        """The model keeps the accepted nodes it processed: the accepted path mapped onto its own tree."""
        if not self._ran_model:  # the suffix candidates alone were verified: they learn from it
            self.suffix.observe(accepted, n_committed)
            return
        path = accepted
        if self._source is not None:
            path = [0]
            for node in accepted[1:]:
                if self._source[node] < 0:
                    break  # a suffix-only node: the model's tree ends here on this path
                path.append(self._source[node])
        self.model.observe(path, n_committed)

    def reset(self, previous: Sequence[int], tokens: Sequence[int], common: int) -> None:
        if self.model is not None:
            self.model.reset(previous, tokens, common)
        self.suffix.reset(previous, tokens, common)

    def forget(self) -> None:
        if self.model is not None:
            self.model.forget()
        self.suffix.forget()

    def prefill(self, tokens: Sequence[int]) -> None:
        """The draft model (if any) processes the committed `tokens` (profiling times its steps on them)."""
        if self.model is not None:
            self.model.prefill(tokens)

    def remember(self, replies: Sequence[Sequence[int]]) -> None:
        """Earlier replies of the session into the suffix drafter's session history (benchmarks of a session)."""
        self.suffix.remember(replies)

    def use_history(self, enabled: bool) -> None:
        """The suffix drafter's index over earlier generations of the session: on, or off (e.g. benchmarks)."""
        self.suffix.use_history(enabled)

    def _suffix_alone(self, tokens: list[int], config: TreeConfig, temperature: float,
                      grammar: Optional[GrammarPaths]) -> Optional[DraftTree]:
        """The suffix candidates that pay on their own (up to `confident_budget`, cut by `pass_cost`, as a gated
        suffix pass proposes them) where the match is confident (the tree a confident match proposes: a tree of
        `confident_budget` nodes is never deeper than that) or that pass is expected to make more tokens per second
        than one with the draft model's tree (`model_expectation`); else None. The suffix tree's own expectation is
        the sum of its candidates' chances (offspec/spec/gain.py), the model's the plan's."""
        nodes = max(config.budget, config.confident_budget)
        alone = replace(config, budget=nodes, confident_budget=nodes, max_depth=nodes)
        tree = self.suffix.propose(tokens, alone, temperature, alone=True, grammar=grammar)
        cost, (accepted, draft) = config.pass_cost, config.model_expectation
        suffix_rate = self.suffix.expected / cost.seconds(tree.n - 1, self.suffix.expected)
        model_rate = (1.0 + accepted) / (draft + cost.seconds(config.budget, 1.0 + accepted))
        return tree if self.suffix.confident or suffix_rate >= model_rate else None

    def _out_for(self, budget: int) -> DraftTree:
        if self._out is None or self._out.capacity != budget + 1:
            self._out = DraftTree(budget + 1, self.suffix.device)
        return self._out


def build_drafter(draft_runner, device: torch.device, suffix_config: SuffixConfig = SuffixConfig(),
                  mapping: Optional[VocabMapping] = None) -> HybridDrafter:
    """The engine's drafter for a loaded pair (`draft_runner` None: no draft model, suffix drafts only). `mapping`:
    the draft has another tokenizer, and proposes through it (offspec/spec/mapped_drafter.py)."""
    model = TreeDrafter(draft_runner) if draft_runner is not None else None
    if model is not None and mapping is not None:
        model = MappedDrafter(model, mapping)
    return HybridDrafter(model, SuffixDrafter(suffix_config, device))
