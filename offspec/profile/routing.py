"""The experts a verify pass routes to, recorded during `offspec profile`'s calibration passes: the coverage curve.

`RoutingRecorder` holds a target's `QExperts` (offspec/formats/experts.py) and, only while `recording()` runs,
is each one's `recorder`: it keeps every call's (T, k) expert ids by layer. Outside it the hook is None, so no
pass (and no output) changes. `distinct_at` turns one pass's routing and its tree's node ranks (by cumulative
draft log-prob, root -1: offspec/profile/measure.py's `_ranks`) into the mean distinct experts per layer among the
root and the B best nodes, for each budget B (the tree at budget B is the top B nodes of the bigger one, as for the
acceptance curve). `experts_section` assembles the profile's `experts` section (offspec/profile/coverage.py), and
`unmissed_read_seconds` prices a miss where none came.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch

from offspec.formats.experts import QExperts, expert_use


class RoutingRecorder:
    """The routing of a model's mixture layers, pass by pass (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, QExperts)]  # module order: layer order
        self._layer = {id(b): i for i, b in enumerate(self.blocks)}
        self.calls: dict[int, list[torch.Tensor]] = {}  # layer -> each call's (T, k) expert ids, in call order

    @property
    def experts_per_layer(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0

    @property
    def layers_read_as_routed(self) -> int:
        """Layers whose experts come from an expert cache (offspec/offload/experts.py) at each call."""
        return sum(b.stream is not None for b in self.blocks)

    def record(self, block: QExperts, top_k_index: torch.Tensor) -> None:
        ids = top_k_index.detach().reshape(-1, top_k_index.shape[-1]).to("cpu", copy=True)  # (T, k)
        self.calls.setdefault(self._layer[id(block)], []).append(ids)

    @contextmanager
    def recording(self) -> Iterator["RoutingRecorder"]:
        """Record the calls made inside (what was recorded before is dropped)."""
        self.calls = {}
        for b in self.blocks:
            b.recorder = self
        try:
            yield self
        finally:
            for b in self.blocks:
                b.recorder = None

    def routing(self, tokens: int) -> Optional[torch.Tensor]:
        """(layers, tokens, k) expert ids of the recorded pass; None where some layer did not see exactly `tokens`
        tokens (no pass, or not the pass asked about)."""
        if not self.blocks or len(self.calls) != len(self.blocks):
            return None
        layers = [torch.cat(self.calls[i]) for i in range(len(self.blocks))]  # (tokens, k) each
        if any(ids.shape[0] != tokens for ids in layers):
            return None
        return torch.stack(layers)  # (layers, tokens, k)


def distinct_at(routing: torch.Tensor, ranks: Sequence[int], budgets: Sequence[int], experts: int) -> list[float]:
    """Mean over layers of the distinct experts among the root and the nodes ranked below B, for each B in
    `budgets`. routing: (layers, n, k) expert ids of a pass over n tokens (root first); ranks: (n,) each node's
    rank among the nodes, the root -1; experts: experts per layer. A budget past the tree's nodes: the whole tree."""
    layers, n, _ = routing.shape
    order = torch.argsort(torch.as_tensor(ranks, dtype=torch.long), stable=True)  # (n,) root first, then by rank
    ordered = routing[:, order].long()  # (layers, n, k)
    hot = torch.zeros(layers, n, experts, dtype=torch.int8)  # (layers, n, E): the experts each token routes to
    hot.scatter_(2, ordered, 1)
    seen = torch.cummax(hot, dim=1).values  # (layers, n, E): routed to by one of the first j + 1 tokens
    counts = seen.sum(dim=2, dtype=torch.float64).mean(dim=0)  # (n,) mean distinct per layer after j + 1 tokens
    return [float(counts[min(int(b), n - 1)]) for b in budgets]


def experts_section(budgets: Sequence[int], passes: Sequence[Sequence[float]], experts_used: int,
                    experts_per_layer: int, layers: int, read_as_routed: bool, routed: int, hits: int,
                    wait_seconds: float) -> dict:
    """The profile's `experts` section: `passes` holds each calibration pass's `distinct_at` over `budgets`
    (the first 0); layers: the mixture layers; routed, hits and wait_seconds are those passes' summed
    `PassStats.experts_routed`, `expert_hits` and `io_wait_seconds`. read_seconds: the wait per missed expert,
    None where no pass missed (the caller may price a miss from the disk's bandwidth instead)."""
    n = len(passes)
    distinct = [round(sum(p[i] for p in passes) / n, 3) for i in range(len(budgets))]
    misses = routed - hits
    return {"budgets": [int(b) for b in budgets], "distinct": distinct, "experts_used": int(experts_used),
            "experts_per_layer": int(experts_per_layer), "layers": int(layers), "read_as_routed": bool(read_as_routed),
            "passes": n, "miss_rate": round(misses / routed, 4) if routed else 0.0,
            "read_seconds": round(wait_seconds / misses, 7) if misses > 0 else None}


def unmissed_read_seconds(model: torch.nn.Module, placement: dict, rates: dict) -> Optional[float]:
    """Seconds one missed expert of `model` would add where no measured pass missed: its bytes at the rate it comes
    at, over the link where the placement holds the experts in RAM (offspec/offload/ram_experts.py), else from the
    disk. `rates`: {"link": bytes/s, "disk": bytes/s}, measured or assumed; None where a rate or the model's expert
    size is unknown."""
    use = expert_use(model)
    rate = rates.get("link" if placement.get("expert_host_bytes") else "disk")
    return use["expert_bytes"] / float(rate) if use and rate else None
