"""A draft model with another tokenizer, as a drafter of target tokens (the mapping: offspec/spec/xvocab.py).

`MappedDrafter` wraps the draft model's `TreeDrafter`, which grows its tree over the draft's own tokens from the
draft's own context (`DraftContext`: the committed text in draft tokens, its KV cache kept for what stays). The
tree it hands the engine is over target tokens (`map_tree`), so the engine, the hybrid merge with suffix candidates
and verification are those of any draft. After a pass, the draft nodes whose text the target accepted stay in the
draft's cache, as a `TreeDrafter`'s accepted nodes do.

It is the "model" drafter of the engine's `HybridDrafter`: `--drafter model`, the profile's acceptance curves and
`--budget auto` treat it as any draft model (its pair, named by the draft, has its own profile), and
`info.extra["draft_mapping"]` says a mapping is in use.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from offspec.config import TreeConfig

from .drafter import Growth, TreeDrafter
from .grammar import GrammarPaths
from .runner import ModelRunner
from .tree import DraftTree
from .xvocab import TRAILING, DraftContext, MappedTree, VocabMapping, map_tree

WINDOW_FILL = 0.75  # the share of the draft's cache slots its committed context may fill (see `MappedDrafter._sync`)


class MappedDrafter:
    """A `TreeDrafter` on a draft model of another vocabulary, proposing target tokens (the `Drafter` interface)."""

    kind = "model"

    def __init__(self, inner: TreeDrafter, mapping: VocabMapping, trailing: float = TRAILING):
        self.inner, self.mapping, self.trailing = inner, mapping, trailing
        self.context = DraftContext(mapping)
        self.caught_up = 0  # draft tokens the last proposal's draft model processed before growing
        self._start = 0  # the first draft token of the context its cache holds (see `_sync`)
        self._out: Optional[DraftTree] = None
        self._last: Optional[tuple[list[int], list[int], MappedTree, bytes, int]] = None  # for `observe`

    @property
    def runner(self) -> ModelRunner:
        return self.inner.runner

    def _sync(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The draft's context for the committed `tokens` (its tokens from `_start` on) and how many of them its cache
        keeps. Another tokenizer may need more tokens for the same text than the cache was sized for (a context
        limit in target tokens): past WINDOW_FILL of its slots the draft keeps the last half of its context only."""
        unchanged = self.context.sync(tokens)
        ids, capacity, start = self.context.ids, self.runner.capacity, self._start
        if unchanged < start or len(ids) - start > capacity * WINDOW_FILL:
            start = 0 if len(ids) <= capacity * WINDOW_FILL else len(ids) - capacity // 2
        kept = max(0, unchanged - start) if start == self._start else 0  # a new window: every position moved
        self._start = start
        return ids[start:], kept

    def reset(self, previous: Sequence[int], tokens: Sequence[int], common: int) -> None:
        old = self.context.ids[self._start :]
        view, kept = self._sync(tokens)
        self.inner.reset(old, view, kept)
        self._last = None

    def forget(self) -> None:
        self.context, self._start = DraftContext(self.mapping), 0
        self.inner.forget()
        self._last = None

    def prefill(self, tokens: Sequence[int]) -> None:
        """The draft model processes the committed `tokens` (in its own tokens), as a proposal would catch up."""
        view, kept = self._sync(tokens)
        self.runner.cache.truncate(kept)
        if view:
            self.runner.extend(view[self.runner.length :])

    @torch.inference_mode()
    def propose(self, tokens: list[int], config: TreeConfig, temperature: float,
                rival: Optional[torch.Tensor] = None, grammar: Optional[GrammarPaths] = None,
                grow: Optional[Growth] = None) -> DraftTree:
        """The draft's tree grown on its own tokens (`rival` as `TreeDrafter.propose` takes it), mapped to a tree of
        target tokens whose root is `tokens[-1]`. `grammar`: the mapped nodes the output's grammar forbids (and
        their descendants) are left out (the draft grows its own tree unconstrained: the grammar is over the
        target's tokens)."""
        view, kept = self._sync(tokens)
        self.runner.cache.truncate(kept)
        out = self._out_for(config.budget + (config.growth if grow is not None else 0))
        out.reset(tokens[-1])
        self._last, self.caught_up = None, 0
        if not view:  # nothing the draft can start from yet (an incomplete character alone)
            return out
        tree = self.inner.propose(view, config, temperature, rival=rival, grow=grow)
        self.caught_up = self.inner.caught_up
        n = tree.n
        draft_tokens = tree.tokens[:n].tolist()  # sync: the mapping runs on the host
        draft_parents = tree.parents[:n].tolist()
        pending = self.context.pending
        mapped = map_tree(self.mapping, draft_tokens, draft_parents, tree.scores[:n].tolist(), pending,
                          max(config.budget, tree.n - 1), self.trailing)
        if grammar is not None:
            mapped = _allowed(mapped, grammar)
        if mapped.tokens:
            out.add_nodes(torch.tensor(mapped.parents), torch.tensor(mapped.tokens), torch.tensor(mapped.scores))
        self._last = (draft_tokens, draft_parents, mapped, pending, len(view))
        return out

    def observe(self, accepted: list[int], n_committed: int) -> None:
        """The draft nodes whose text the accepted target tokens spell (the deepest such path) stay in the draft's
        cache and context; the rest of the committed text is encoded at the next proposal."""
        if self._last is None:
            return
        draft_tokens, draft_parents, mapped, pending, base = self._last
        self._last = None
        target = self.mapping.target
        spelled = pending + target.text([mapped.tokens[i - 1] for i in accepted[1:]])
        children: dict[int, list[int]] = {}
        for i in range(1, len(draft_tokens)):
            children.setdefault(draft_parents[i], []).append(i)
        texts, path, node = mapped.texts, [0], 0
        while True:
            fits = [c for c in children.get(node, ()) if texts[c] is not None and len(texts[c]) > len(texts[node])
                    and spelled.startswith(texts[c])]
            if not fits:
                break
            node = max(fits, key=lambda c: (len(texts[c]), -c))  # the longest text; ties: the likelier node
            path.append(node)
        self.inner.observe(path, n_committed)
        kept = self.runner.length - base  # the nodes on the path the draft had processed (a prefix of it)
        self.context.append([draft_tokens[i] for i in path[1 : 1 + kept]])

    def _out_for(self, budget: int) -> DraftTree:
        if self._out is None or self._out.capacity != budget + 1:
            self._out = DraftTree(budget + 1, self.runner.device)
        return self._out


def _allowed(mapped: MappedTree, grammar: GrammarPaths) -> MappedTree:
    """`mapped` without the nodes the grammar forbids (a forbidden node's descendants are forbidden too)."""
    ok = grammar.allowed_nodes(mapped.tokens, [p - 1 for p in mapped.parents])
    new_index = {0: 0}  # mapped node (0: the root, k: tokens[k - 1]) -> kept node
    tokens, parents, scores = [], [], []
    for k, keep in enumerate(ok, start=1):
        if keep:
            new_index[k] = len(tokens) + 1
            tokens.append(mapped.tokens[k - 1])
            parents.append(new_index[mapped.parents[k - 1]])
            scores.append(mapped.scores[k - 1])
    return MappedTree(tokens=tokens, parents=parents, scores=scores, texts=mapped.texts)
