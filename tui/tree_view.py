"""A small text rendering of one pass's speculation tree, readable for trees of thousands of nodes.

Three parts: a summary, a per-depth table (nodes at that depth, the accepted token, the largest rejected
alternatives with the size of their subtrees) and the top branches from the root as a little tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from rich.text import Text

from offspec.types import TreeSnapshot

Decode = Callable[[Sequence[int]], str]

ACCEPTED = "bold green"
BONUS = "bold cyan"
REJECTED = "dim"
LABEL_WIDTH = 10


class TokenLabels:
    """Token id -> short printable label, through the generator's `decode` when it has one (cached)."""

    def __init__(self, decode: Optional[Decode] = None):
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._cache:
            self._cache[token] = self._label(token)
        return self._cache[token]

    def _label(self, token: int) -> str:
        if self._decode is None:
            return f"#{token}"
        try:
            text = self._decode([token])
        except Exception:  # a decoder that rejects an id (e.g. padding) must not break the panel
            return f"#{token}"
        if not isinstance(text, str) or not text or "\ufffd" in text:  # special, or part of a character
            return f"#{token}"
        text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        if len(text) > LABEL_WIDTH - 2:
            text = text[: LABEL_WIDTH - 3] + "…"
        return f"'{text}'"


@dataclass(frozen=True)
class TreeShape:
    """Children, depths and subtree sizes of a snapshot, computed once (tolerant of malformed input)."""

    children: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]
    size: tuple[int, ...]

    @classmethod
    def of(cls, tree: TreeSnapshot) -> "TreeShape":
        n = len(tree.tokens)
        parents = [p if 0 <= p < n else -1 for p in tree.parents[:n]] + [-1] * (n - len(tree.parents))
        children: list[list[int]] = [[] for _ in range(n)]
        for node, parent in enumerate(parents):
            if parent >= 0 and node != 0:
                children[parent].append(node)
        depth = [-1] * n
        order: list[int] = []
        if n:
            depth[0] = 0
            stack = [0]
            while stack:  # iterative: deep chains must not hit the recursion limit
                node = stack.pop()
                order.append(node)
                for child in children[node]:
                    if depth[child] < 0:
                        depth[child] = depth[node] + 1
                        stack.append(child)
        size = [1] * n
        for node in reversed(order):
            if parents[node] >= 0 and node != 0:
                size[parents[node]] += size[node]
        return cls(tuple(tuple(c) for c in children), tuple(depth), tuple(size))


def depth_counts(shape: TreeShape) -> list[int]:
    """Nodes at depth 1, 2, ... (the root, depth 0, is not a drafted node)."""
    counts: list[int] = []
    for d in shape.depth:
        if d >= 1:
            while len(counts) < d:
                counts.append(0)
            counts[d - 1] += 1
    return counts


def render_tree(tree: Optional[TreeSnapshot], decode: Optional[Decode] = None, *, alternatives: int = 2,
                branches: int = 3, branch_depth: int = 2, max_depth_rows: int = 24,
                labels: Optional[TokenLabels] = None) -> Text:
    """The panel's text for `tree` (None before the first pass).

    `alternatives`: rejected drafts named per depth; `branches`: children shown per node in the top
    branches; `branch_depth`: levels of top branches; `max_depth_rows`: rows of the per-depth table.
    """
    if tree is None or not tree.tokens:
        return Text("No speculation tree yet: send a message.", style="dim")
    return _Renderer(tree, labels or TokenLabels(decode)).render(alternatives, branches, branch_depth, max_depth_rows)


class _Renderer:
    def __init__(self, tree: TreeSnapshot, labels: TokenLabels):
        self.tree, self.labels = tree, labels
        self.shape = TreeShape.of(tree)
        self.counts = depth_counts(self.shape)
        path = [n for n in tree.accepted if 0 <= n < len(tree.tokens)]
        self.path = path if path and path[0] == 0 else [0] + path
        self.on_path = set(self.path)
        self.out = Text()

    def node(self, node: int) -> str:
        return self.labels(self.tree.tokens[node])

    def render(self, alternatives: int, branches: int, branch_depth: int, max_depth_rows: int) -> Text:
        out = self.out
        out.append(f"{len(self.tree.tokens) - 1} drafted · {len(self.path) - 1} accepted + bonus · "
                   f"depth {len(self.counts)}\n", style="bold")
        self.accepted_path()
        out.append("\n")
        self.depth_table(alternatives, max_depth_rows)
        out.append("\ntop branches\n", style="bold")
        out.append(f"● {self.node(0)} (root)\n")
        self.branches(0, "", 0, branches, branch_depth)
        return out

    def accepted_path(self) -> None:
        out = self.out
        out.append("accepted: ")
        if len(self.path) == 1:
            out.append("(none) ", style=REJECTED)
        for node in self.path[1:]:
            out.append(self.node(node), style=ACCEPTED)
            out.append(" ")
        out.append("⇒ ")
        out.append(self.labels(self.tree.bonus_token), style=BONUS)
        out.append(" (target)\n", style=REJECTED)

    def depth_table(self, alternatives: int, max_rows: int) -> None:
        out, shape, counts, path = self.out, self.shape, self.counts, self.path
        out.append(f"{'depth':>5} {'nodes':>5}  {'accepted':<{LABEL_WIDTH}}  other drafts ·subtree\n", style="bold")
        for d in range(1, min(len(counts), max_rows) + 1):
            out.append(f"{d:>5} {counts[d - 1]:>5}  ")
            chosen = path[d] if d < len(path) else None
            if chosen is not None:
                out.append(f"{self.node(chosen):<{LABEL_WIDTH}}", style=ACCEPTED)
            elif d == len(path):  # where the path ends the target chose its own (bonus) token
                out.append(f"{self.labels(self.tree.bonus_token):<{LABEL_WIDTH}}", style=BONUS)
            else:
                out.append(f"{'-':<{LABEL_WIDTH}}", style=REJECTED)
            out.append("  ")
            if d - 1 < len(path):  # the drafts that competed with the accepted token at this depth
                others = sorted((c for c in shape.children[path[d - 1]] if c != chosen), key=lambda c: -shape.size[c])
                for child in others[:alternatives]:
                    out.append(f"{self.node(child)}·{shape.size[child]} ", style=REJECTED)
                rest = others[alternatives:]
                if rest:
                    out.append(f"+{len(rest)}·{sum(shape.size[c] for c in rest)}", style=REJECTED)
            out.append("\n")
        if len(counts) > max_rows:
            out.append(f"  … {len(counts) - max_rows} deeper levels, {sum(counts[max_rows:])} nodes\n",
                       style=REJECTED)

    def branches(self, node: int, prefix: str, level: int, branches: int, branch_depth: int) -> None:
        out, shape = self.out, self.shape
        kids = sorted(shape.children[node], key=lambda c: (c not in self.on_path, -shape.size[c]))
        shown, hidden = kids[:branches], kids[branches:]
        for i, child in enumerate(shown):
            last = i == len(shown) - 1 and not hidden
            out.append(prefix + ("└─ " if last else "├─ "), style=REJECTED)
            out.append(self.node(child), style=ACCEPTED if child in self.on_path else None)
            out.append(f" ·{shape.size[child]}\n" if shape.children[child] else "\n", style=REJECTED)
            if shape.children[child] and level + 1 < branch_depth:
                self.branches(child, prefix + ("   " if last else "│  "), level + 1, branches, branch_depth)
        if hidden:
            out.append(f"{prefix}└─ +{len(hidden)} more ·{sum(shape.size[c] for c in hidden)}\n", style=REJECTED)
