"""The acceptance walk: which part of the tree the target agrees with. Pure code, no model inside.

Walk from the root: at each node take the target's own token there (argmax when greedy, a sample
from its adjusted distribution when sampling). If that token is a child of the node in the tree,
move to the child; otherwise emit it and stop. Every emitted token is exactly the target's choice
given the tokens before it, so the output is lossless; the tree only decides how many tokens one
target pass yields (accepted + 1).
"""

from __future__ import annotations

from typing import Callable, Sequence


def acceptance_walk(tokens: Sequence[int], parents: Sequence[int], choose: Callable[[int], int]) -> tuple[list[int], int]:
    """Return (accepted node indices, root first; the bonus token emitted after them).

    `tokens`, `parents`: host-side lists for the n tree nodes (node 0 is the root).
    `choose(i)`: the target's token at node i (it is only called for nodes on the walk).
    """
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tokens)):
        children[(parents[i], tokens[i])] = i
    path = [0]
    while True:
        token = choose(path[-1])
        child = children.get((path[-1], token))
        if child is None:
            return path, token
        path.append(child)


def best_children(parents: Sequence[int], scores: Sequence[float]) -> dict[int, int]:
    """node -> its best-scored child (the first one on a tie), for the nodes that have children."""
    best: dict[int, int] = {}
    for i in range(1, len(parents)):
        p = parents[i]
        if p not in best or scores[i] > scores[best[p]]:
            best[p] = i
    return best


def likely_path(start: int, best: dict[int, int], limit: int) -> list[int]:
    """The nodes the walk visits from `start` if the target takes the draft's best guess at every step: `start`,
    then the best child (`best_children`) of each node on the way, at most `limit` nodes."""
    path = [start]
    while len(path) < limit and path[-1] in best:
        path.append(best[path[-1]])
    return path
