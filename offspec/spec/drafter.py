"""Drafters propose a speculation tree and observe which part the target accepted.

`Drafter` is the interface; `TreeDrafter` is SpecExec's: a resident draft model grows the tree of the
most probable continuations, expanding the best nodes in batched draft forwards. A single chain
(classic speculative decoding) is the same drafter with `TreeConfig.chain(depth)`. The model-free
`SuffixDrafter` (offspec/spec/suffix_drafter.py) and the `HybridDrafter` that merges both (offspec/spec/hybrid.py)
implement the same interface, and so does `MappedDrafter` (offspec/spec/mapped_drafter.py), a draft model of
another vocabulary whose tree is mapped to target tokens; the engine holds a `HybridDrafter`, whose modes and
session history the rest of offspec uses through `EngineDrafter`.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from offspec.config import TreeConfig

from .grammar import GrammarPaths
from .runner import ModelRunner
from .sampling import draft_logprobs
from .tree import DraftTree


Growth = Callable[[], bool]
"""Asked by a draft model whose tree has reached its budget: True lets the tree take `TreeConfig.beams` more nodes
(up to `TreeConfig.growth` past the budget) and ask again; the engine answers True while the target pass's first
streamed layer is still being read (ShadowSpec: nodes drafted then cost the pass nothing). It is asked before any
layer of that pass runs, so every node is in the tree the target verifies."""


class Drafter(Protocol):
    kind: str  # what built the last tree: "model", "suffix" or "hybrid" (PassStats.drafter)
    caught_up: int  # committed tokens the last proposal's draft model processed before growing (PassStats.caught_up)

    def propose(self, tokens: list[int], tree: TreeConfig, temperature: float,
                grammar: Optional[GrammarPaths] = None, grow: Optional[Growth] = None) -> DraftTree:
        """Build a tree whose root is `tokens[-1]` (the last committed token). `grammar`: the output is constrained,
        and this is the grammar's state at the root: propose only tokens it allows (the target never takes others).
        `grow`: once the tree has its budget, a draft model may ask it for more (see `Growth`); others ignore it."""

    def observe(self, accepted: list[int], n_committed: int) -> None:
        """The target accepted tree nodes `accepted` (root first); `n_committed` tokens are now committed."""

    def reset(self, previous: Sequence[int], tokens: Sequence[int], common: int) -> None:
        """The committed sequence changes from `previous` to `tokens`; they share their first `common` tokens."""

    def forget(self) -> None:
        """Drop everything carried between calls (caches, indexes, session history)."""


class EngineDrafter(Drafter, Protocol):
    """The drafter the engine holds, as the generator, the API, `offspec bench` and `offspec profile` use it
    (offspec/spec/hybrid.py's `HybridDrafter`): a `Drafter` with several modes, one picked per pass by
    `TreeConfig.drafter`, and a session history of replies. The engine's passes call the `Drafter` part only."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes it can run ("model", "suffix", "hybrid"; without a draft model, "suffix" only)."""

    @property
    def runner(self) -> Optional[ModelRunner]:
        """The draft model's runner (None: no draft model); profiling times its steps."""

    def check_mode(self, mode: Optional[str]) -> str:
        """`mode` (None: the default one) if it can run it, else a one-line OffspecError that says what to do."""

    def remember(self, replies: Sequence[Sequence[int]]) -> None:
        """Put earlier replies of the session into its history (benchmarks replaying a session)."""

    def use_history(self, enabled: bool) -> None:
        """Draft from the earlier replies of the session too (on), or from the conversation alone (off)."""

    def prefill(self, tokens: Sequence[int]) -> None:
        """The draft model (if any) processes the committed `tokens` in its own tokens: the context that profiling
        times draft steps on."""


class TreeDrafter:
    """SpecExec tree growth on a draft model with a slot KV cache.

    The draft cache holds the committed tokens it has seen (slots [0, length)); during growth, each
    expanded node gets a scratch slot after them, so nothing is recomputed between draft steps. After
    the pass, the accepted expanded nodes are gathered onto the committed slots. A draft made from the target
    borrows the target's cache instead (`ModelRunner.borrow_cache`): its committed slots are the target's own.
    """

    kind = "model"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.caught_up = 0
        self._tree: DraftTree | None = None
        self._base = 0  # committed length when the current tree was proposed

    def _tree_for(self, config: TreeConfig, grow: Optional[Growth]) -> DraftTree:
        capacity = config.budget + (config.growth if grow is not None else 0) + 1 + config.beams * config.branch
        if self._tree is None or self._tree.capacity != capacity:
            self._tree = DraftTree(capacity, self.runner.device)
        return self._tree

    def reset(self, previous: Sequence[int], tokens: Sequence[int], common: int) -> None:
        self.runner.cache.truncate(common)
        self.runner.refresh_tokens(tokens[:common])  # a reduced head's rows for the conversation it keeps

    def forget(self) -> None:
        self.runner.cache.truncate(0)
        self.runner.forget_tokens()

    def prefill(self, tokens: Sequence[int]) -> None:
        """The draft model processes the committed `tokens`, as a proposal would catch up on them (a draft that
        borrows the target's cache runs only those the target has not cached)."""
        if self.runner.borrows:
            self.runner.adopt(tokens)
        self.runner.extend(list(tokens[self.runner.length :]))

    @torch.inference_mode()
    def propose(self, tokens: list[int], config: TreeConfig, temperature: float,
                rival: Optional[torch.Tensor] = None, grammar: Optional[GrammarPaths] = None,
                grow: Optional[Growth] = None) -> DraftTree:
        """Grow the tree. `rival` (r,): scores of other candidates for the same budget (a hybrid's suffix
        nodes): growth stops once no open node can beat the `budget`-th best of both (see `can_improve`).
        `grammar`: each expanded node's children are the draft's likeliest tokens among those the grammar allows
        after its path (the draft's distribution renormalized over them). `grow`: asked each time the tree is done
        at its current size; while it says True the size goes up by `config.beams` nodes, to at most `budget +
        config.growth` (see `Growth`)."""
        runner, tree = self.runner, self._tree_for(config, grow)
        limit, most = config.budget, config.budget + (config.growth if grow is not None else 0)
        n_committed = len(tokens)
        if runner.borrows:  # the target's keys and values of what it committed are the draft's
            runner.adopt(tokens)
        if runner.length >= n_committed:  # the root's draft logits are needed: re-run it
            runner.cache.truncate(n_committed - 1)
        self.caught_up = n_committed - runner.length  # 1-2 after a pass that ran the model, more after others
        hidden = runner.extend(tokens[runner.length :])  # (hidden,) of the root: catch up on new tokens
        tree.reset(tokens[-1])
        tree.expanded[0] = True
        # the tree keeps up to `most` candidates (the best `limit` are the tree; the rest are there if it may grow)
        self._add_children(tree, torch.zeros(1, dtype=torch.long, device=runner.device), hidden[None], config,
                           temperature, grammar, most)
        self._base = n_committed
        next_slot = n_committed  # first free scratch slot
        root_pos = n_committed - 1
        while True:
            frontier = tree.frontier(config.beams, config.max_depth)  # (k,) best open nodes
            if limit < most and tree.n - 1 > limit:  # candidates past the limit are kept for growth, not expanded
                frontier = frontier[tree.scores[frontier] >= tree.best_score(limit)]
            if not tree.can_improve(limit, frontier, rival):
                if limit >= most or not grow():
                    break
                limit = min(most, limit + config.beams)  # the weights are still loading: a bigger tree
                continue
            k = int(frontier.numel())
            if next_slot + k > runner.capacity:
                break  # out of scratch slots: the tree stays as it is (still valid)
            slots = torch.arange(next_slot, next_slot + k, device=runner.device)  # (k,)
            tree.slots[frontier] = slots
            tree.expanded[frontier] = True
            next_slot += k
            n = tree.n
            with_slot = (tree.slots[:n] >= 0).nonzero().squeeze(1)  # (s,) expanded nodes; sync for the size
            visible = torch.zeros((k, next_slot), dtype=torch.bool, device=runner.device)  # (k, next_slot)
            visible[:, :n_committed] = True
            visible[:, tree.slots[with_slot]] = tree.ancestors[frontier][:, with_slot]
            hidden = runner.forward(tree.tokens[frontier], root_pos + tree.depths[frontier], slots, visible)
            self._add_children(tree, frontier, hidden, config, temperature, grammar, most)
        tree.trim(limit)
        return tree

    def _add_children(self, tree: DraftTree, parents: torch.Tensor, hidden: torch.Tensor, config: TreeConfig,
                      temperature: float, grammar: Optional[GrammarPaths], keep: int) -> None:
        logits = self.runner.logits(hidden)  # (k, V) or (k, n) of a reduced head
        if grammar is not None:
            logits = self._allowed_only(logits, tree, parents, grammar)
        logp = draft_logprobs(logits, temperature)
        if grammar is not None:
            logp = logp.nan_to_num_(nan=float("-inf"))  # a row that allows nothing: no children
        top = torch.topk(logp, min(config.branch, logp.shape[-1]), dim=-1)  # (k, branch)
        tree.add_children(parents, self.runner.token_ids(top.indices), top.values)
        tree.trim(keep)

    def _allowed_only(self, logits: torch.Tensor, tree: DraftTree, parents: torch.Tensor,
                      grammar: GrammarPaths) -> torch.Tensor:
        """`logits` of the expanded nodes `parents` with the tokens the grammar forbids after each one's path at
        -inf."""
        n = tree.n
        tokens, up = tree.tokens[:n].tolist(), tree.parents[:n].tolist()  # sync: the grammar walks paths on the host
        paths = []
        for node in parents.tolist():
            path = []
            while node > 0:
                path.append(tokens[node])
                node = up[node]
            paths.append(path[::-1])
        allowed = grammar.allowed_after(paths)  # (k, target vocabulary) bool
        ids = self.runner.vocab_ids  # a reduced head's token ids (None: its rows are the token ids)
        if ids is not None:
            allowed = allowed[:, ids.cpu()]
        elif allowed.shape[1] != logits.shape[1]:  # a draft whose head has more or fewer rows than the target's
            width = logits.shape[1]
            allowed = allowed[:, :width] if allowed.shape[1] >= width else torch.nn.functional.pad(
                allowed, (0, width - allowed.shape[1]))
        return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))

    def observe(self, accepted: list[int], n_committed: int) -> None:
        """Keep the accepted nodes the draft already processed (a prefix of the path) in its cache (a borrowed cache
        has the target's own keys and values of them: nothing to keep)."""
        if self.runner.borrows:
            return
        tree = self._tree
        slots = tree.slots[torch.tensor(accepted[1:], dtype=torch.long, device=tree.device)].tolist()  # sync
        kept = []
        for s in slots:
            if s < 0:
                break
            kept.append(s)
        src = torch.tensor(kept, dtype=torch.long, device=self.runner.device)
        self.runner.cache.keep(src, self._base + len(kept))
