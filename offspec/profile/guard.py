"""Measured speeds decide between the planned tree and the target alone (or gated suffix passes).

The plan predicts that its tree beats the target alone. On a machine busier than when it was profiled
(another process took a core, the disk slowed down) that can stop being true, and only a measurement under
the same conditions tells. So `budget="auto"` times both: while trees run, one pass in `plain_every` runs
without a tree (it still emits the target's own token, so nothing is lost); when the target alone is
measured faster than the tree by more than `margin`, passes run without a tree, with a tree now and then
(after `tree_every` passes, doubling while such probes keep losing, up to `max_tree_every`), and trees come
back when one wins. Rates compare like with like: a tree pass counts the tokens the acceptance estimate
expects of it (the realized count of one pass is too noisy), a plain pass one token.

For the drafters that gate suffix candidates (suffix, hybrid), the alternative to the planned tree is not the
target alone but a gated suffix pass (offspec/profile/adapt.py): it costs no draft step and takes a copied run
whole where there is one, so it counts the tokens it emitted (no acceptance curve predicts them). On a CPU
with both models resident, a measured profile may plan one-node trees that beat the target alone on paper and
lose to gated suffix passes on code that copies what it was given.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GuardConfig:
    window: int = 8  # recent passes of each kind whose median time counts
    min_tree: int = 4  # tree passes timed before judging
    min_plain: int = 2  # plain passes timed before judging
    plain_every: int = 16  # while trees run: one pass in this many runs without a tree
    tree_every: int = 16  # while trees are off: a tree pass after this many plain passes ...
    max_tree_every: int = 256  # ... doubling each time it loses, up to this
    margin: float = 0.05  # the other kind must be this much faster to switch


class SpeedGuard:
    """`wants_tree()` before each pass; `observe_tree` / `observe_plain` after it."""

    def __init__(self, config: GuardConfig = GuardConfig()):
        self.config = config
        self.tree_seconds: deque[float] = deque(maxlen=config.window)  # seconds per tree pass
        self.tree_tokens: deque[float] = deque(maxlen=config.window)  # tokens expected of each
        self.plain_seconds: deque[float] = deque(maxlen=config.window)
        self.plain_tokens: deque[float] = deque(maxlen=config.window)  # 1 for a plain pass; a gated pass's emitted
        self.trees_on = True
        self.tree_every = config.tree_every
        self._since = 0  # passes since the last pass of the other kind
        self._probing = False  # the current pass is a tree probe (trees are off), or a pass among them
        self.switches: list[dict] = []  # when and why the guard switched (kept for the summary)
        self.passes = 0

    def wants_tree(self, planned: bool = True) -> bool:
        """Whether the next pass should grow a tree. `planned`: the plan wants trees; when it does not (a
        re-plan from measured times turned them off), trees are only probed now and then, like when the
        guard itself turned them off, so that the draft's time is measured again."""
        self._since += 1
        self._probing = not (planned and self.trees_on)
        if not self._probing:
            if len(self.plain_seconds) < self.config.min_plain:
                due = self._since > max(2, self.config.min_tree)  # the first probes come early
            else:
                due = self._since >= self.config.plain_every
            return not due
        return self._since > self.tree_every

    def observe_tree(self, seconds: float, expected_tokens: float) -> None:
        self.passes += 1
        self.tree_seconds.append(seconds)
        self.tree_tokens.append(expected_tokens)
        if not self._probing:
            self._judge()
            return
        self._since = 0  # a probe: judge on it alone (the other tree times are from before trees went off)
        latest = expected_tokens / seconds if seconds > 0 else 0.0
        plain = self.plain_rate()
        if plain is not None and latest > plain * (1 + self.config.margin):
            if not self.trees_on:
                self._switch(True, latest, plain)
        else:
            self.tree_every = min(self.config.max_tree_every, self.tree_every * 2)

    def observe_plain(self, seconds: float, tokens: float = 1.0) -> None:
        """A pass without the planned tree: the target alone (one token), or a gated suffix pass (`tokens` emitted)."""
        self.passes += 1
        self.plain_seconds.append(seconds)
        self.plain_tokens.append(tokens)
        if not self._probing:  # a plain probe among trees
            self._since = 0
            self._judge()

    def tree_rate(self) -> Optional[float]:
        if len(self.tree_seconds) < self.config.min_tree:
            return None
        seconds = statistics.median(self.tree_seconds)
        return statistics.fmean(self.tree_tokens) / seconds if seconds > 0 else None

    def plain_rate(self) -> Optional[float]:
        if len(self.plain_seconds) < self.config.min_plain:
            return None
        seconds = statistics.median(self.plain_seconds)
        return statistics.fmean(self.plain_tokens) / seconds if seconds > 0 else None

    def _judge(self) -> None:
        tree, plain = self.tree_rate(), self.plain_rate()
        if tree is not None and plain is not None and plain > tree * (1 + self.config.margin):
            self._switch(False, tree, plain)

    def _switch(self, trees_on: bool, tree: float, plain: float) -> None:
        self.trees_on = trees_on
        self._since = 0
        self.tree_every = self.config.tree_every
        if trees_on:
            self.tree_seconds.clear()  # the old tree times predate the switch
            self.tree_tokens.clear()
        self.switches.append({"at_pass": self.passes, "trees": trees_on, "tree_tokens_per_second": round(tree, 4),
                              "plain_tokens_per_second": round(plain, 4)})

    def reset(self) -> None:
        """Forget every time (the machine changed: e.g. a different thread count); keep the current mode."""
        self.tree_seconds.clear()
        self.tree_tokens.clear()
        self.plain_seconds.clear()
        self.plain_tokens.clear()
        self._since = 0

    def forget_trees(self) -> None:
        """Forget the tree times (a re-plan changed the tree)."""
        self.tree_seconds.clear()
        self.tree_tokens.clear()

    def summary(self) -> dict:
        tree, plain = self.tree_rate(), self.plain_rate()
        return {"trees": self.trees_on, "tree_tokens_per_second": round(tree, 4) if tree else None,
                "plain_tokens_per_second": round(plain, 4) if plain else None, "switches": self.switches[-10:]}
