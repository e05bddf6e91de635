"""Drafting without a draft model: continuations of text already seen (SuffixDecoding-style).

`SuffixDrafter` keeps a suffix index (`offspec.spec.suffix_index`) over the conversation (system prompt, every
turn, the output so far: the committed token sequence) and, optionally, a bounded index over the earlier
generations of the session. Each pass it finds the longest suffix of the conversation seen before and
proposes the most frequent continuations of its occurrences as a tree, best first, in the same tensor
format as the model drafter. A node's score is the log of its estimated chance of acceptance:

    score = log((count / occurrences) * q(m)^depth)

(count: occurrences continuing along the node's path; m: the match length; q(m): the chance that the target
continues a match of length m one more token, learned from the suffix trees verified so far, prior
m / (m + match_half)). It never increases along a path, so the tree is trimmed and merged exactly like a draft
model's, and it is on the scale of the draft model's cumulative log-probabilities: in the hybrid, a deep
candidate of a short match no longer outranks the model's nodes (a flat score per occurrence did, and the
hybrid accepted less than the model alone at the same budget: 6.9 against 8.0 tokens at 32, 8 calibration
prompts; now 7.9). Candidates reach at most `spec_factor * m` tokens deep: a long match speculates far, a
short one a little (adaptive speculation).
A long match whose best continuation is clear (`SuffixConfig.confident_match`, `confident_share`) may
propose up to `TreeConfig.confident_budget` nodes instead of `budget`, as deep as that (`max_depth` limits
the model's growth, not such a copy): copying code that was given is where long drafts pay, and the hybrid
drafter then skips the draft model.
Any tree is lossless (the target verifies every token), so these scores only decide what is proposed.

With `TreeConfig.pass_cost` (set by `budget="auto"`), a tree verified as it is (suffix mode, or a confident
hybrid pass) keeps only the candidates that pay for their place in the target's pass (`offspec.spec.gain`), by
the same acceptance estimate. Where nothing pays, the tree is empty and the pass costs what the target alone
costs.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from offspec.config import SuffixConfig, TreeConfig

from .gain import ContinuationRates, best_prefix
from .grammar import GrammarPaths
from .suffix_index import Match, SuffixIndex, continuations
from .tree import DraftTree


class SuffixDrafter:
    kind = "suffix"
    caught_up = 0  # no draft model to catch up

    def __init__(self, config: SuffixConfig = SuffixConfig(), device: torch.device | str = "cpu"):
        self.config = config.validate()
        self.device = torch.device(device)
        self.conversation = SuffixIndex(config.key_length)  # the committed sequence, bounded by the context
        self.history: Optional[SuffixIndex] = (SuffixIndex(config.key_length, max_tokens=config.global_tokens)
                                               if config.global_tokens else None)  # earlier generations
        self._prompt_length = 0  # tokens of the current conversation that came in as its prompt
        self._tree: Optional[DraftTree] = None
        self.match = Match(0, ())  # the last proposal's match (its length and occurrences)
        self.confident = False  # the last match was long and its best continuation clear (see SuffixConfig)
        self.expected = 1.0  # tokens the last proposal cut by `pass_cost` expects of its pass: 1 + their chances
        # q(m), learned from verified suffix-only trees; kept across conversations (it describes the pair)
        self.rates = ContinuationRates(config.match_half, max_length=config.max_match)
        self._verified: Optional[tuple[int, set[int]]] = None  # the last tree as verified: (m, nodes with children)

    # --- the Drafter interface -------------------------------------------------------------------
    def reset(self, previous: Sequence[int], tokens: Sequence[int], common: int) -> None:
        """A new or edited conversation: what the previous one generated joins the session history."""
        if self.history is not None and len(previous) > self._prompt_length:
            self.history.add_sequence(previous[self._prompt_length :])
        self.conversation.truncate(common)
        self._prompt_length = len(tokens)

    def forget(self) -> None:
        """Drop the conversation and the session history."""
        self.conversation.clear()
        if self.history is not None:
            self.history.clear()
        self._prompt_length = 0

    def remember(self, replies: Sequence[Sequence[int]]) -> None:
        """Put earlier replies of the session into the session history, oldest first (as `reset` does when a
        conversation ends); without a history index (`use_history(False)`), nothing."""
        if self.history is not None:
            for reply in replies:
                self.history.add_sequence(reply)

    def use_history(self, enabled: bool) -> None:
        """Switch the index over earlier generations on (empty, bounded by `global_tokens`) or off (dropped)."""
        if not enabled:
            self.history = None
        elif self.history is None and self.config.global_tokens:
            self.history = SuffixIndex(self.config.key_length, max_tokens=self.config.global_tokens)

    def propose(self, tokens: Sequence[int], config: TreeConfig, temperature: float = 0.0,
                alone: bool = True, grammar: Optional[GrammarPaths] = None) -> DraftTree:
        """At most `config.budget` continuations of the longest matching suffix of `tokens`; up to
        `config.confident_budget` when the match is long and its best continuation clear (`confident`).
        `alone`: the tree is verified as it is (False: the hybrid merges it with the model's unless confident);
        such a tree is cut to the candidates that pay when `config.pass_cost` is set (see the module doc).
        `grammar`: only the continuations the output's grammar allows are proposed."""
        self.conversation.extend(tokens[self.conversation.end :])  # the tokens committed since the last pass
        self.expected = 1.0
        occurrences, m = self._longest(tokens)
        c = self.config
        self.confident = m >= c.confident_match and _top_share(occurrences) >= c.confident_share
        budget = max(config.budget, config.confident_budget) if self.confident else config.budget
        tree = self._tree_for(max(config.budget, config.confident_budget))
        tree.reset(int(tokens[-1]))
        verified = alone or self.confident
        self._verified = (m, set()) if verified else None
        if m < c.min_match:
            return tree
        # the depth cap is the model's growth limit; a confident copy may run as deep as its nodes
        cap = max(config.max_depth, budget) if self.confident else config.max_depth
        depth = min(cap, max(1, math.ceil(c.spec_factor * m)))
        cont = continuations(occurrences, budget, depth)
        keep = list(range(len(cont.tokens)))  # candidates proposed, in tree order (parents first)
        if grammar is not None:  # a forbidden candidate's descendants are forbidden too: `keep` stays a tree
            allowed = grammar.allowed_nodes(cont.tokens, cont.parents)
            keep = [i for i in keep if allowed[i]]
        if verified and config.pass_cost is not None:
            keep = self._paying(cont, m, config, keep)
        new_index = {-1: 0}  # candidate -> tree node (the root is node 0)
        for i in keep:
            new_index[i] = len(new_index)
        probs = self._probabilities(cont, m)
        scores = torch.tensor([math.log(probs[i]) for i in keep], dtype=torch.float32)  # (k,)
        parents = torch.tensor([new_index[cont.parents[i]] for i in keep], dtype=torch.long)  # (k,)
        tree.add_nodes(parents, torch.tensor([cont.tokens[i] for i in keep], dtype=torch.long), scores)
        if verified:
            self._verified = (m, {new_index[cont.parents[i]] for i in keep})
        return tree

    def _probabilities(self, cont, m: int) -> list[float]:
        """Each candidate's chance of acceptance, (count / occurrences) * q(m)^depth: a product along the path,
        so never above its parent's."""
        q = self.rates.rate(m)
        probs: list[float] = []
        for k, p in zip(cont.counts, cont.parents):
            probs.append(q * (k / cont.total if p < 0 else probs[p] * (k / cont.counts[p])))
        return probs

    def _paying(self, cont, m: int, config: TreeConfig, among: Sequence[int]) -> list[int]:
        """The candidates of `among` (in tree order) worth verifying under `config.pass_cost`, most probable first
        (parents first: a child is never more probable than its parent, and the sort is stable)."""
        probs = self._probabilities(cont, m)
        order = sorted(among, key=lambda i: -probs[i])
        n = best_prefix([probs[i] for i in order], config.pass_cost)
        self.expected = 1.0 + sum(probs[i] for i in order[:n])
        return order[:n]

    def observe(self, accepted: list[int], n_committed: int) -> None:
        """Learn q(m) from a tree verified as proposed (`accepted`: its path, root first). The committed tokens
        themselves are indexed at the start of the next proposal."""
        if self._verified is None:
            return
        m, parents = self._verified
        self.rates.observe(m, len(accepted) - 1, left=accepted[-1] in parents)
        self._verified = None

    # --- the search ------------------------------------------------------------------------------
    def _longest(self, tokens: Sequence[int]) -> tuple[list[tuple[SuffixIndex, int]], int]:
        """The (index, position) occurrences of the longest suffix of `tokens` found in the conversation or
        the history (both, when they match equally long; the most recent `max_occurrences`), and its length."""
        c = self.config
        found = [(index, index.longest_match(tokens, c.max_match, c.max_occurrences))
                 for index in (self.history, self.conversation) if index is not None]
        m = max(match.length for _, match in found)
        occurrences = [(index, j) for index, match in found if match.length == m for j in match.positions]
        occurrences = occurrences[-c.max_occurrences :]
        self.match = Match(m, tuple(j for _, j in occurrences))
        return occurrences, m

    def _tree_for(self, budget: int) -> DraftTree:
        if self._tree is None or self._tree.capacity != budget + 1:
            self._tree = DraftTree(budget + 1, self.device)
        return self._tree


def _top_share(occurrences: Sequence[tuple[SuffixIndex, int]]) -> float:
    """The share of occurrences followed by their most common next token."""
    if not occurrences:
        return 0.0
    counts: dict[int, int] = {}
    for index, j in occurrences:
        t = index.token(j)
        counts[t] = counts.get(t, 0) + 1
    return max(counts.values()) / len(occurrences)
