"""The speculative engine: one target pass per call of `speculative_step`, lossless.

State: the committed token sequence `tokens`. Invariants between passes:
- the target's cache holds tokens[:-1]; the last token (the root) is not yet processed by the target;
- the draft's cache holds a prefix of `tokens` (it catches up at the start of the next proposal).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from offspec.config import TreeConfig
from offspec.errors import OffspecError
from offspec.types import PassStats, TreeSnapshot
from offspec.util.device import sync_compute

from .drafter import EngineDrafter
from .runner import ModelRunner
from .sampling import TokenChooser
from .tree import DraftTree
from .verify import acceptance_walk, best_children, likely_path

HEAD_ROWS = 4  # the fewest walk positions whose LM-head rows are computed in one call (where rows are batch invariant)
LIKELY = math.log(0.5)  # ... more where the tree's scores say the walk reaches them with at least this chance


def _clock(device: torch.device) -> float:
    # sync: the compute stream only, so that timings include queued compute; not torch.cuda.synchronize, which
    # would also wait for the copy stream loading the next pass's first layers (it must go on while the draft grows)
    sync_compute(device)
    return time.perf_counter()


class _Growth:
    """The drafter's `grow` (offspec/spec/drafter.py): yes while the target's next streamed layer is still on its
    way, before any layer of the pass has run. Counts the yeses."""

    def __init__(self, target: ModelRunner):
        self.target, self.granted = target, 0

    def __call__(self) -> bool:
        if self.target.weights_loading():  # no wait: a look at the streamer's state
            self.granted += 1
            return True
        return False


class SpeculativeEngine:
    def __init__(self, target: ModelRunner, drafter: Optional[EngineDrafter], max_context: int, max_budget: int):
        self.target = target
        self.drafter = drafter  # its passes call the `Drafter` part only (a plain Drafter does for them alone)
        self.max_context = max_context  # committed tokens never exceed this
        self.max_budget = max_budget  # the target cache reserves room for a tree of this many nodes
        self.tokens: list[int] = []

    # --- the committed sequence ------------------------------------------------------------------
    def reset_to(self, tokens: list[int]) -> int:
        """Make `tokens` the committed sequence, reusing the cached common prefix. Returns tokens reused."""
        if not tokens:
            raise OffspecError("the prompt is empty; give at least one token of text")
        if len(tokens) >= self.max_context:
            raise OffspecError(f"the prompt is {len(tokens)} tokens but the context limit is {self.max_context}; "
                               f"shorten it or raise --max-context")
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        self.target.cache.truncate(min(common, len(tokens) - 1))
        if self.drafter is not None:
            self.drafter.reset(self.tokens, tokens, common)
        self.tokens = list(tokens)
        reused = self.target.length
        self.target.extend(self.tokens[self.target.length : -1])  # prefill what is not cached yet
        return reused

    def forget(self) -> None:
        """Forget the conversation: both caches and whatever the drafter carries (its session history too)."""
        self.tokens = []
        self.target.cache.truncate(0)
        if self.drafter is not None:
            self.drafter.forget()

    @property
    def room(self) -> int:
        """Tokens that may still be committed before the context limit."""
        return self.max_context - len(self.tokens)

    # --- passes ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def autoregressive_step(self, chooser: TokenChooser) -> tuple[list[int], PassStats]:
        """The baseline: the target alone, one token per pass."""
        t0 = _clock(self.target.device)
        io0, ex0 = self.target.io_counters(), self.target.expert_counters()
        root_slot = self.target.length  # == len(tokens) - 1
        hidden = self.target.extend([self.tokens[-1]])
        token = chooser.choose(self.target.logits(hidden))  # sync: the token is needed on the host
        self.tokens.append(token)
        assert self.target.length == len(self.tokens) - 1 == root_slot + 1
        io1, ex1 = self.target.io_counters(), self.target.expert_counters()
        stats = PassStats(tree_size=0, accepted=0, emitted=1, draft_seconds=0.0,
                          target_seconds=_clock(self.target.device) - t0, budget=0,
                          io_wait_seconds=io1[1] - io0[1], bytes_streamed=io1[0] - io0[0],
                          experts_routed=ex1[0] - ex0[0], expert_hits=ex1[1] - ex0[1])
        return [token], stats

    def score_tree(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's ONE forward over the root and every tree node, on top of its cached prefix.

        Returns the (n, hidden) final hidden states and the (n,) cache slots they were written to.
        """
        target, device = self.target, self.target.device
        T, n = target.length, tree.n
        root_pos = len(self.tokens) - 1  # == T
        slots = torch.arange(T, T + n, device=device)  # (n,) root and nodes, in tree order
        visible = torch.zeros((n, T + n), dtype=torch.bool, device=device)  # (n, T+n)
        visible[:, :T] = True  # the committed prefix
        visible[:, T:] = tree.attention_mask()  # each node: itself and its ancestors
        positions = root_pos + tree.depths[:n]  # (n,) siblings share a position
        return target.forward(tree.tokens[:n], positions, slots, visible), slots

    @property
    def head_rows(self) -> int:
        """Walk positions one LM-head call covers at least (`_walk_logits`): HEAD_ROWS where the target's head is
        row-invariant, else 1 (a call per position). The planner's cost model charges the head by calls."""
        return HEAD_ROWS if self.target.head_is_row_invariant else 1

    def _walk_logits(self, hidden: torch.Tensor, parents: list[int], scores: torch.Tensor
                     ) -> Callable[[int], torch.Tensor]:
        """The target's logits at tree node i, for the walk. Where its LM head gives a row the same bits whatever
        the batch (offspec's CPU kernels), the walk's next rows are computed together, along the draft's
        likeliest path from the node asked for: one read of the head's weights for many positions (a one-row head
        is bound by memory; on AMX 32 rows cost 2.7 one-row reads). A call takes the positions the tree's scores
        give at least a LIKELY chance of being reached from there (cumulative log-probabilities: the chance of
        a node given its ancestor is the difference of their scores), at least HEAD_ROWS; a walk that used every
        row of a call and goes on asks for twice as many next (a long copy the scores undersold). Elsewhere (GEMMs
        that round by batch shape) one row at a time, as decoding without a draft does, so that both compute the
        same numbers."""
        target = self.target
        if len(parents) == 1 or not target.head_is_row_invariant:
            return lambda i: target.logits(hidden[i])
        score = scores.tolist()  # sync: the path is chosen on the host (on a CPU: no wait)
        best = best_children(parents, score)
        done: dict[int, torch.Tensor] = {}
        last: list[int] = []  # the previous call's rows

        def logits_at(i: int) -> torch.Tensor:
            nonlocal last
            if i not in done:
                path = likely_path(i, best, len(parents))
                likely = sum(1 for k in path if score[k] - score[i] >= LIKELY)  # a prefix: scores never increase
                going_on = bool(last) and best.get(last[-1]) == i  # the walk used every row of the last call
                rows = path[: max(2 * len(last) if going_on else HEAD_ROWS, likely)]
                last = rows
                done.update(zip(rows, target.logits(hidden[rows])))  # (len(rows), V) in one call
            return done[i]

        return logits_at

    @torch.inference_mode()
    def speculative_step(self, config: TreeConfig, chooser: TokenChooser, snapshot: bool = False
                         ) -> tuple[list[int], PassStats]:
        """One pass: the draft grows a tree, the target verifies all of it at once, the path is kept."""
        if self.drafter is None:
            raise OffspecError("speculation needs a drafter")
        target, device = self.target, self.target.device
        T = target.length  # target cache slots in use; the root goes to slot T
        room = min(self.max_budget, target.capacity - T - 1)  # tree nodes the target cache has slots for
        if config.budget > room or config.confident_budget > room:  # near the context limit: a smaller tree
            config = replace(config, budget=max(min(config.budget, room), 1),
                             confident_budget=min(config.confident_budget, room))
        if config.budget + config.growth > room:
            config = replace(config, grow_nodes=room - config.budget)
        grow = _Growth(target) if target.io is not None and config.growth > 0 else None  # a streamed target

        t0 = _clock(device)
        grammar = chooser.grammar.paths() if chooser.grammar is not None else None  # the output's grammar at the root
        tree = self.drafter.propose(self.tokens, config, chooser.sampling.temperature, grammar=grammar, grow=grow)
        t1 = _clock(device)
        io0, ex0 = target.io_counters(), target.expert_counters()

        n = tree.n
        tokens_host = tree.tokens[:n].tolist()  # sync: the walk runs on the host (and the ids are checked there)
        outside = [t for t in tokens_host if not 0 <= t < target.vocab_size]
        if outside:  # a draft whose head is wider than the target's embedding: never fed to the target
            raise OffspecError(f"the draft proposed token id {outside[0]}, outside the target's vocabulary of "
                               f"{target.vocab_size} ids; use a draft with the target's tokenizer, or --draft none")
        hidden, slots = self.score_tree(tree)

        parents_host = tree.parents[:n].tolist()
        logits_at = self._walk_logits(hidden, parents_host, tree.scores[:n])
        path, bonus = acceptance_walk(tokens_host, parents_host, lambda i: chooser.choose(logits_at(i)))
        accepted = path[1:]
        new_tokens = [tokens_host[i] for i in accepted] + [bonus]
        target.cache.keep(slots[torch.tensor(path, device=device)], T + len(path))
        self.tokens.extend(new_tokens)
        self.drafter.observe(path, len(self.tokens))
        t2 = _clock(device)
        io1, ex1 = target.io_counters(), target.expert_counters()

        tree_view = None
        if snapshot:
            tree_view = TreeSnapshot(tokens=tuple(tokens_host), parents=tuple(parents_host),
                                     accepted=tuple(path), bonus_token=bonus)
        stats = PassStats(tree_size=n - 1, accepted=len(accepted), emitted=len(new_tokens), draft_seconds=t1 - t0,
                          target_seconds=t2 - t1, budget=config.budget, depth_counts=tuple(tree.depth_counts()),
                          tree=tree_view, io_wait_seconds=io1[1] - io0[1], bytes_streamed=io1[0] - io0[0],
                          experts_routed=ex1[0] - ex0[0], expert_hits=ex1[1] - ex0[1], drafter=self.drafter.kind, caught_up=self.drafter.caught_up,
                          grown_nodes=max(0, n - 1 - config.budget) if grow is not None and grow.granted else 0)
        return new_tokens, stats
