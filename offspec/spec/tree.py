"""The speculation tree as tensors (SpecExec). Pure tensor code: no model inside.

Node 0 is the root: the last committed token, whose target logits give the first new token.
Every other node is a drafted token with its parent, depth (1 = child of the root) and cumulative
draft log-probability. The tree is kept compact: nodes [0, n) are all live, and a parent's index is
always lower than its children's, so index order is a topological order.

Growth (see `TreeDrafter`): expand the best unexpanded nodes, add their top-`branch` children, then
`trim` to the global top-`budget` nodes by cumulative log-prob. Since log p <= 0, a child never scores
above its parent; ties are broken by index (older first), so the kept set is always a valid subtree.
"""

from __future__ import annotations

from typing import Optional

import torch


class DraftTree:
    """A pre-allocated, compact token tree of at most `capacity` nodes (root included)."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.device = torch.device(device)
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(capacity, **long)  # (capacity,) token id per node
        self.parents = torch.full((capacity,), -1, **long)  # (capacity,) parent index, -1 for the root
        self.depths = torch.zeros(capacity, **long)  # (capacity,) 0 for the root
        self.scores = torch.zeros(capacity, dtype=torch.float32, device=self.device)  # (capacity,) cum. log-prob
        self.expanded = torch.zeros(capacity, dtype=torch.bool, device=self.device)  # (capacity,)
        self.slots = torch.full((capacity,), -1, **long)  # (capacity,) draft KV slot of expanded nodes, else -1
        # (capacity, capacity) bool: ancestors[i, j] is True when j is i or an ancestor of i.
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=self.device)
        self.n = 0

    # --- building --------------------------------------------------------------------------------
    def reset(self, root_token: int) -> None:
        self.n = 1
        self.tokens[0] = root_token
        self.parents[0] = -1
        self.depths[0] = 0
        self.scores[0] = 0.0
        self.expanded[0] = False
        self.slots[0] = -1
        self.ancestors[0].zero_()
        self.ancestors[0, 0] = True

    def add_children(self, parents: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append children: `parents` (k,) node indices; `tokens`, `logprobs` (k, b) for b children each.

        Children whose log-prob is -inf (probability 0) are not added. The caller trims afterwards.
        """
        k, b = tokens.shape
        child_parents = parents[:, None].expand(k, b).reshape(-1)  # (k*b,)
        child_scores = (self.scores[parents][:, None] + logprobs.float()).reshape(-1)  # (k*b,)
        keep = torch.isfinite(child_scores)  # (k*b,) bool
        child_parents, child_scores = child_parents[keep], child_scores[keep]
        child_tokens = tokens.reshape(-1)[keep]
        m = int(child_tokens.numel())  # sync: the number of new nodes sizes the writes below
        if self.n + m > self.capacity:
            raise RuntimeError(f"tree capacity {self.capacity} exceeded ({self.n} + {m} nodes)")
        idx = torch.arange(self.n, self.n + m, device=self.device)  # (m,)
        self.tokens[idx] = child_tokens
        self.parents[idx] = child_parents
        self.depths[idx] = self.depths[child_parents] + 1
        self.scores[idx] = child_scores
        self.expanded[idx] = False
        self.slots[idx] = -1
        self.ancestors[idx] = self.ancestors[child_parents]
        self.ancestors[idx, idx] = True
        self.n += m

    def add_nodes(self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> None:
        """Append m nodes with their cumulative `scores`: `parents`, `tokens`, `scores` (m,). A parent is an
        existing node or an earlier node of the same call (parent index < the node's own index)."""
        m, n = int(tokens.numel()), self.n
        if n + m > self.capacity:
            raise RuntimeError(f"tree capacity {self.capacity} exceeded ({n} + {m} nodes)")
        if m == 0:
            return
        parents = parents.to(self.device)
        idx = torch.arange(n, n + m, device=self.device)  # (m,)
        if bool((parents >= idx).any() | (parents < 0).any()):  # sync: a malformed tree must not be built
            raise ValueError("add_nodes: every parent must be an earlier node")
        self.tokens[idx] = tokens.to(self.device)
        self.parents[idx] = parents
        self.scores[idx] = scores.to(self.device, torch.float32)
        self.expanded[idx] = False
        self.slots[idx] = -1
        # depths and ancestor rows level by level: a level's parents are all in the tree before it is written
        level = torch.zeros(m, dtype=torch.long)  # (m,) 0: the parent is an existing node
        for i, p in enumerate(parents.tolist()):  # sync: a host walk over the new nodes (m is a tree budget)
            if p >= n:
                level[i] = level[p - n] + 1
        for lv in range(int(level.max()) + 1):
            rows = idx[(level == lv).to(self.device)]  # (r,) the nodes of this level
            par = self.parents[rows]
            self.depths[rows] = self.depths[par] + 1
            self.ancestors[rows] = self.ancestors[par]
            self.ancestors[rows, rows] = True
        self.n = n + m

    def trim(self, budget: int) -> None:
        """Keep the root and the `budget` best other nodes (stable: older nodes win ties); compact."""
        n = self.n
        if n - 1 <= budget:
            return
        order = torch.sort(self.scores[1:n], descending=True, stable=True).indices + 1  # (n-1,)
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)  # (n,)
        keep[0] = True
        keep[order[:budget]] = True
        kept = keep.nonzero().squeeze(1)  # (budget+1,) in index order, so parents stay before children
        new_index = torch.cumsum(keep, 0) - 1  # (n,) old index -> new index (valid where kept)
        m = budget + 1
        self.tokens[:m] = self.tokens[kept]
        parents = self.parents[kept]
        self.parents[:m] = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        self.depths[:m] = self.depths[kept]
        self.scores[:m] = self.scores[kept]
        self.expanded[:m] = self.expanded[kept]
        self.slots[:m] = self.slots[kept]
        self.ancestors[:m, :m] = self.ancestors[kept][:, kept]
        self.ancestors[:m, m:n] = False
        self.n = m

    # --- queries ---------------------------------------------------------------------------------
    def frontier(self, max_beams: int, max_depth: int) -> torch.Tensor:
        """The (up to) `max_beams` best unexpanded nodes shallower than `max_depth`, best first."""
        n = self.n
        open_ = ~self.expanded[:n] & (self.depths[:n] < max_depth)  # (n,) bool
        scores = torch.where(open_, self.scores[:n], torch.full_like(self.scores[:n], float("-inf")))
        k = min(max_beams, n)
        top = torch.topk(scores, k)
        return top.indices[torch.isfinite(top.values)]  # sync on the boolean index

    def best_score(self, rank: int) -> torch.Tensor:
        """() the `rank`-th best score of the nodes past the root (rank <= n - 1)."""
        return torch.topk(self.scores[1 : self.n], rank).values[-1]

    def can_improve(self, budget: int, frontier: torch.Tensor, rival: Optional[torch.Tensor] = None) -> bool:
        """Whether expanding `frontier` could still change the top-`budget` set.

        A child scores at most its parent, so when the tree is full and no frontier node beats the
        worst kept node, no candidate can enter: growth is done. `rival` (r,): scores of other candidates
        for the same budget (a hybrid's suffix nodes); then the bar is the `budget`-th best of both sets
        (a node both propose counts twice there, so growth may stop a little early; the tree stays valid).
        """
        if frontier.numel() == 0:
            return False
        scores = self.scores[1 : self.n]
        if rival is not None and rival.numel():
            scores = torch.cat([scores, rival.to(scores.device, scores.dtype)])
        if scores.numel() < budget:
            return True
        worst = torch.topk(scores, budget).values[-1]
        return bool(self.scores[frontier].max() > worst)  # sync: a host-side decision to stop drafting

    def attention_mask(self) -> torch.Tensor:
        """(n, n) bool: node i attends to node j when j is i or one of its ancestors."""
        return self.ancestors[: self.n, : self.n]

    def depth_counts(self) -> list[int]:
        """Nodes per depth 1, 2, ... (the root excluded)."""
        if self.n <= 1:
            return []
        return torch.bincount(self.depths[1 : self.n]).tolist()[1:]


def merge_trees(a: DraftTree, b: DraftTree, budget: int, out: DraftTree) -> torch.Tensor:
    """Merge trees `a` and `b` (the same root) into `out`: the union of their paths, where the same token at
    the same place is one node scored by the better of its two scores, trimmed to the best `budget` nodes
    (ties: `a`'s nodes first, then `b`'s new ones in their order).

    Scores stay non-increasing along every path (each tree's are, and max keeps that), and a parent's index
    is below its children's, so the kept set is a valid tree. Returns (out.n,) long: each node's index in
    `a`, or -1 for a node only `b` proposed.
    """
    if a.n == 0 or b.n == 0 or int(a.tokens[0]) != int(b.tokens[0]):  # sync: two host-side checks
        raise ValueError("merge_trees: both trees need the same root")
    device = a.device
    na, nb = a.n, b.n
    vocab = int(torch.cat([a.tokens[:na], b.tokens[:nb]]).max()) + 1  # sync: sizes the node keys
    keys = a.parents[:na] * vocab + a.tokens[:na]  # (na,) a node's key: (parent, token); the root's is < 0
    keys[0] = -1
    tokens, parents, scores = a.tokens[:na].clone(), a.parents[:na].clone(), a.scores[:na].clone()
    b_to_merged = torch.zeros(nb, dtype=torch.long, device=device)  # (nb,) b's root is the merged root 0
    b_depths = b.depths[:nb]
    for depth in range(1, int(b_depths.max()) + 1):  # sync: a level's parents are mapped before it
        rows = (b_depths == depth).nonzero().squeeze(1)  # (r,) b's nodes at this depth, in b's order
        par = b_to_merged[b.parents[rows]]  # (r,) their parents among the merged nodes
        row_keys = par * vocab + b.tokens[rows]  # (r,)
        order = torch.argsort(keys)
        pos = torch.searchsorted(keys[order], row_keys).clamp(max=keys.numel() - 1)
        found = keys[order][pos] == row_keys  # (r,) bool: the same token at the same place
        at = torch.where(found, order[pos], torch.zeros_like(pos))  # (r,) merged index where found
        scores[at[found]] = torch.maximum(scores[at[found]], b.scores[rows[found]])
        new = rows[~found]  # (q,) nodes only b has: appended in b's order
        first = tokens.numel()
        new_ids = torch.arange(first, first + new.numel(), device=device)
        b_to_merged[rows] = torch.where(found, at, torch.zeros_like(at))
        b_to_merged[new] = new_ids
        tokens = torch.cat([tokens, b.tokens[new]])
        parents = torch.cat([parents, par[~found]])
        scores = torch.cat([scores, b.scores[new]])
        keys = torch.cat([keys, row_keys[~found]])
    source = torch.cat([torch.arange(na, device=device), torch.full((tokens.numel() - na,), -1, device=device)])
    # keep the root and the `budget` best others (stable: lower merged index first on ties), in index order
    m = tokens.numel()
    keep = torch.zeros(m, dtype=torch.bool, device=device)  # (m,)
    keep[0] = True
    keep[torch.sort(scores[1:], descending=True, stable=True).indices[:budget] + 1] = True
    kept = keep.nonzero().squeeze(1)  # (k,) ancestor-closed, parents before children
    new_index = torch.cumsum(keep, 0) - 1  # (m,) merged index -> out index (valid where kept)
    out.reset(int(tokens[0]))
    rest = kept[1:]
    out.add_nodes(new_index[parents[rest]], tokens[rest], scores[rest])
    return source[kept]
