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

    def can_improve(self, budget: int, frontier: torch.Tensor) -> bool:
        """Whether expanding `frontier` could still change the top-`budget` set.

        A child scores at most its parent, so when the tree is full and no frontier node beats the
        worst kept node, no candidate can enter: growth is done.
        """
        if frontier.numel() == 0:
            return False
        if self.n - 1 < budget:
            return True
        worst = self.scores[1 : self.n].min()
        return bool(self.scores[frontier].max() > worst)  # sync: a host-side decision to stop drafting

    def attention_mask(self) -> torch.Tensor:
        """(n, n) bool: node i attends to node j when j is i or one of its ancestors."""
        return self.ancestors[: self.n, : self.n]

    def depth_counts(self) -> list[int]:
        """Nodes per depth 1, 2, ... (the root excluded)."""
        if self.n <= 1:
            return []
        return torch.bincount(self.depths[1 : self.n]).tolist()[1:]
