"""What a tree costs a mixture of experts whose experts are read as routed: the experts its tokens touch.

A tree's tokens route to the union of their experts, so a pass over the root and B nodes reads more experts than a
pass over one token: uniform top-8-of-128 routing would touch 29 distinct experts per layer for 4 tokens and 82 for
16, against 8 for one. Real routing is correlated (a tree's nodes are alternatives at the same few positions), so
the **coverage curve** is measured: `offspec profile`'s calibration passes (offspec/profile/measure.py) record which
experts each token of the verify pass was routed to in every layer (offspec/profile/routing.py), and for every
candidate budget B the mean, over passes and layers, of the distinct experts among the root and the B best nodes of
the tree (SpecExec's tree at budget B is the top-B nodes of the bigger one, by cumulative draft log-prob: the same
argument the acceptance curve uses). Budget 0 is one token: the experts a token is routed to (`experts_used`).

**Pricing** (`ExpertReads`): where the target reads its experts as routed (an expert cache on a CPU device), a pass
of T tokens pays, beyond the measured pass curve,

    coverage(T - 1) * layers * miss_rate * read_seconds

- the pass curve holds no expert reads: the timing sweep (offspec/profile/timing.py) runs one token id over and over,
  whose few experts stay in the cache after the warm-up call, so its curve is the dense pass and the experts' compute;
  reads are what this adds, at one token as well as at B + 1 (the target alone pays its own token's misses);
- miss_rate: the share of the calibration passes' routed experts the cache did not hold (`PassStats.experts_routed`,
  `expert_hits`): measured with the real cache, policy and prefetch, not the cache's share of the experts (which
  assumes routing spreads evenly, while real routing has hot experts the cache keeps);
- read_seconds: the seconds the decode waited on the expert cache in those passes per expert it missed (its own
  reads and ranges the read-ahead still had in flight): the time a miss adds to a pass, overlap with compute
  included, which the disk's bandwidth (offspec/profile/hardware.py) would overstate; where no pass missed,
  the expert's bytes at that bandwidth (what online re-pricing starts from if misses appear).

Online (offspec/profile/adapt.py), the passes' own `experts_routed` and `expert_hits` re-price it: the distinct
experts a pass ran against the curve's prediction for its tree (`scaled`: the excess over one token's experts
scaled) and the window's miss rate (`observed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from offspec.errors import OffspecError

# budgets the report shows (nodes), where measured: one token, then every 4x
SHOWN_BUDGETS = (4, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class CoverageCurve:
    """Mean distinct experts per layer a verify pass of the root and `budget` tree nodes routes to; budget 0: one
    token (`experts_used`). Non-decreasing, between `experts_used` and `experts_per_layer`."""

    budgets: tuple[int, ...]  # tree nodes, strictly increasing, the first 0
    distinct: tuple[float, ...]
    experts_used: int  # experts one token is routed to in a layer (top k)
    experts_per_layer: int

    @classmethod
    def of(cls, budgets: Sequence[int], distinct: Sequence[float], experts_used: int, experts_per_layer: int,
           what: str = "expert coverage") -> "CoverageCurve":
        budgets, distinct = [int(b) for b in budgets], [float(d) for d in distinct]
        if not budgets or len(budgets) != len(distinct):
            raise OffspecError(f"{what}: budgets and distinct must be non-empty lists of the same length")
        if budgets[0] < 0 or budgets != sorted(set(budgets)):
            raise OffspecError(f"{what}: budgets must be >= 0 and strictly increasing, got {budgets}")
        if not 1 <= experts_used <= experts_per_layer:
            raise OffspecError(f"{what}: experts_used {experts_used} must be in [1, experts_per_layer "
                               f"{experts_per_layer}]")
        if budgets[0] != 0:  # one token routes to exactly its top k
            budgets, distinct = [0, *budgets], [float(experts_used), *distinct]
        monotone, best = [], 0.0
        for d in distinct:  # a bigger tree holds the smaller one's tokens: it never touches fewer experts
            best = max(best, min(float(experts_per_layer), max(float(experts_used), d)))
            monotone.append(best)
        monotone[0] = float(experts_used)
        return cls(tuple(budgets), tuple(monotone), int(experts_used), int(experts_per_layer))

    def __call__(self, budget: float) -> float:
        """Interpolated in log2(tokens) (tokens = budget + 1); past the largest budget measured, the last segment's
        slope, up to every expert (an unmeasured tree is not assumed cheap)."""
        if budget <= 0:
            return self.distinct[0]
        x = math.log2(budget + 1)
        pts = list(zip(self.budgets, self.distinct))
        for (b0, d0), (b1, d1) in zip(pts, pts[1:]):
            if budget <= b1:
                x0, x1 = math.log2(b0 + 1), math.log2(b1 + 1)
                return d0 + (d1 - d0) * (x - x0) / (x1 - x0)
        return self._beyond(budget)

    def _beyond(self, budget: float) -> float:
        if len(self.budgets) == 1:  # one token only: nothing says how a tree spreads; every token its own experts
            return min(float(self.experts_per_layer), self.experts_used * (budget + 1))
        (b0, d0), (b1, d1) = (self.budgets[-2], self.distinct[-2]), (self.budgets[-1], self.distinct[-1])
        slope = (d1 - d0) / (math.log2(b1 + 1) - math.log2(b0 + 1))
        return min(float(self.experts_per_layer), d1 + slope * (math.log2(budget + 1) - math.log2(b1 + 1)))

    def ratio(self, budget: float) -> float:
        """Experts a tree of `budget` nodes touches per layer, per expert one token touches."""
        return self(budget) / self.experts_used

    def scaled(self, factor: float) -> "CoverageCurve":
        """Each budget's excess over one token's experts times `factor` (online: trees routed wider or narrower
        than at calibration), within [experts_used, experts_per_layer]."""
        k, e = float(self.experts_used), float(self.experts_per_layer)
        return replace(self, distinct=tuple(min(e, k + max(0.0, factor) * (d - k)) for d in self.distinct))

    @property
    def largest(self) -> int:
        return self.budgets[-1]

    def describe(self) -> str:
        """'1 token 8, 16 nodes 23.4, 64 nodes 41.0' at the shown budgets that were measured, and the largest."""
        shown = [b for b in self.budgets[1:] if b in SHOWN_BUDGETS] + [self.largest]
        parts = [f"1 token {self.experts_used}"]
        parts += [f"{b} node{'s' if b != 1 else ''} {self(b):.1f}" for b in sorted(set(shown)) if b > 0]
        return ", ".join(parts)


@dataclass(frozen=True)
class ExpertReads:
    """The expert reads a target pass pays where its experts are read as routed (see the module doc)."""

    coverage: CoverageCurve
    layers: int  # layers whose experts are read as routed
    miss_rate: float  # share of the routed (layer, expert) pairs the cache did not hold
    read_seconds: float  # seconds one missed expert adds to a pass

    def reads(self, tokens: int) -> float:
        """Experts a pass of `tokens` tokens (the root and tokens - 1 nodes) reads from SSD."""
        return self.coverage(max(0, tokens - 1)) * self.layers * self.miss_rate

    def seconds(self, tokens: int) -> float:
        return self.reads(tokens) * self.read_seconds

    def scaled(self, factor: float) -> "ExpertReads":
        """Reads `factor` times as slow (the target's time scale: a slower disk)."""
        return replace(self, read_seconds=self.read_seconds * factor)

    def observed(self, coverage_scale: float, miss_rate: float) -> "ExpertReads":
        """These reads with the coverage's excess scaled and another miss rate (online re-pricing)."""
        return replace(self, coverage=self.coverage.scaled(coverage_scale), miss_rate=min(1.0, max(0.0, miss_rate)))

    @property
    def priced(self) -> bool:
        return self.miss_rate > 0 and self.read_seconds > 0


def coverage_of(section: dict, source: str = "profile") -> CoverageCurve:
    """The coverage curve of a profile's `experts` section."""
    return CoverageCurve.of(section["budgets"], section["distinct"], int(section["experts_used"]),
                            int(section["experts_per_layer"]), what=f"{source}: experts")


def expert_reads_of(section: Optional[dict], source: str = "profile") -> Optional[ExpertReads]:
    """The pricing of a profile's `experts` section; None where the target does not read its experts as routed
    (a dense model, a resident mixture, a mixture streamed by whole layers) or nothing says what a read costs."""
    if not section or not section.get("read_as_routed") or section.get("read_seconds") is None:
        return None
    return ExpertReads(coverage_of(section, source), int(section["layers"]), float(section.get("miss_rate", 0.0)),
                       float(section["read_seconds"]))


def no_tree_note(reads: ExpertReads, budget: int, accepted: float, one_token_seconds: float) -> str:
    """Why no tree pays on a mixture read as routed: what the best tree, of `budget` nodes, touches and costs
    against a pass of one token (`one_token_seconds`: the target alone, its own reads included)."""
    c = reads.coverage
    nodes = f"{budget} node{'s' if budget != 1 else ''}"
    return (f"the experts a tree touches cost more than its accepted tokens bring: the best tree ({nodes}) "
            f"touches {c.ratio(budget):.1f}x the experts of one token ({c(budget):.1f} of {c.experts_per_layer} "
            f"per layer, {reads.miss_rate:.0%} of them missing from the expert cache), "
            f"{reads.seconds(budget + 1) * 1e3:.0f} ms of reads a pass against {one_token_seconds * 1e3:.0f} ms for "
            f"a pass of one token, for {accepted:.2f} accepted tokens")


class ExpertWindow:
    """Online re-pricing (offspec/profile/adapt.py): the recent passes' (tree nodes, experts routed, cache hits),
    and the reads they say a pass pays now. A pass's `experts_routed` is its distinct (layer, expert) pairs, so
    divided by the layers it is the distinct experts per layer the curve predicts for its tree."""

    def __init__(self, reads: ExpertReads, window: int = 24, min_passes: int = 8, tolerance: float = 0.2):
        self.initial, self.reads = reads, reads  # the profile's pricing, the one in force
        self.window, self.min_passes, self.tolerance = window, min_passes, tolerance
        self.passes: list[tuple[int, int, int]] = []  # (tree nodes, experts routed, hits), oldest first
        self.coverage_scale, self.miss_rate = 1.0, reads.miss_rate
        self._since = 0  # passes since the window was last weighed (every `min_passes`)

    def observe(self, nodes: int, routed: int, hits: int) -> bool:
        """One pass; True where the pricing in force moved by more than `tolerance` (then `reads` is the new)."""
        if routed <= 0:
            return False
        self.passes = (self.passes + [(nodes, routed, hits)])[-self.window:]
        self._since += 1
        if len(self.passes) < self.min_passes or self._since < self.min_passes:
            return False
        self._since = 0
        c, layers = self.initial.coverage, max(1, self.initial.layers)
        k = float(c.experts_used)
        excess = [(r / layers - k, c(n) - k) for n, r, _ in self.passes if n > 0 and c(n) > k]
        scale = sum(o for o, _ in excess) / sum(p for _, p in excess) if excess else self.coverage_scale
        scale = max(0.0, scale)
        miss = 1.0 - sum(h for _, _, h in self.passes) / sum(r for _, r, _ in self.passes)
        moved = (abs(scale - self.coverage_scale) > self.tolerance * max(self.coverage_scale, 0.05)
                 or abs(miss - self.miss_rate) > self.tolerance * max(self.miss_rate, 0.05))
        if moved:
            self.coverage_scale, self.miss_rate = scale, miss
            self.reads = self.initial.observed(scale, miss)
        return moved

    def summary(self) -> dict:
        return {"coverage_scale": round(self.coverage_scale, 4), "miss_rate": round(self.miss_rate, 4),
                "passes": len(self.passes)}
