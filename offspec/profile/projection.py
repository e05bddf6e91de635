"""`offspec plan`: project tokens/s for hardware you do not have, from a hardware profile and an acceptance curve.

Nothing is measured: pass times come from a roofline model of the hardware profile's documented figures.
The target's weights go to the device until it is full (after the draft, the KV cache, the activations and a
runtime reserve), then to host RAM (streamed over the host->device link from pinned memory), then to the SSD
(streamed at the disk's read speed). One pass costs max(streaming, compute) plus per-layer overhead, where compute
is max(2 * params * tokens / usable FLOP/s, weight bytes / usable memory bandwidth). On a GPU the largest tree
(max_budget) is what the card can compute usefully in one pass (offload.estimates.compute_budget: at most twice the
one-token pass's floor), and the KV cache and activations are reserved for that tree; offspec's CUDA layers keep no
attention scores, so the activations are a few hundred bytes per token and hidden unit. Every assumption is returned
with the plan, and the CLI labels the result as a projection.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from offspec.errors import OffspecError

from offspec.offload.estimates import compute_budget

from .curves import AcceptanceCurve, CostCurve
from .planner import PairCosts, Plan, PlannerConfig, plan

# bytes per weight as stored and streamed: bf16; ggml Q8_0 (8.5 bits) and Q4_1 (5 bits: --quant int8 / int4);
# a Q4_K_M GGUF (about 4.85 bits over a model's linears); bitsandbytes NF4 with its fp32 absmax per 64
BYTES_PER_PARAM = {"none": 2.0, "int8": 34 / 32, "int4": 20 / 32, "q4_k_m": 4.85 / 8, "nf4": 0.5 + 4 / 64}
CPU_DENSE_BYTES = 4.0  # offspec computes in float32 on a CPU
# a draft made from the target (`--draft self`): every decoder layer requantized to one of offspec's K-quant types
# (offspec/models/self_draft.py), ggml's Q2_K and Q3_K blocks (84 and 110 bytes per 256 weights)
SELF_BYTES_PER_PARAM = {"Q2_K": 84 / 256, "Q3_K": 110 / 256}
MAX_BUDGET = 4096  # the engine's default largest tree (LoadConfig.max_budget)
# (params, layers, hidden) of common dense decoder sizes; others are interpolated in log(params)
SHAPES = ((0.5e9, 24, 896), (1.5e9, 28, 1536), (3e9, 28, 2048), (7e9, 32, 4096), (13e9, 40, 5120),
          (34e9, 48, 8192), (70e9, 80, 8192), (180e9, 80, 14848), (405e9, 126, 16384))


@dataclass(frozen=True)
class Assumptions:
    """Every number the projection assumes besides the hardware profile, in one place."""

    compute_efficiency: float = 0.5  # share of peak dense FLOP/s that the model's matmuls reach
    memory_efficiency: float = 0.8  # share of peak memory bandwidth a weight read reaches
    layer_overhead_s: float = 1.5e-4  # per decoder layer per forward: kernel launches, Python (GPU, eager PyTorch)
    cpu_layer_overhead_s: float = 5e-4  # the same on a CPU
    device_reserve_bytes: float = 1e9  # runtime context, kernel workspaces and fragmentation on the device
    host_reserve_bytes: float = 8e9  # RAM left to the OS and the rest
    kv_heads: int = 8  # grouped-query attention (Llama 3, Qwen 2.5 large models)
    head_dim: int = 128
    vocab: int = 128_256  # Llama 3's vocabulary (the LM head is kept on the device)
    context: int = 4096  # tokens of conversation the KV cache is sized for
    max_budget: Optional[int] = None  # the largest tree; None: on a GPU what the card computes usefully, else 4096
    inter_ratio: float = 3.5  # MLP width over hidden size (Llama 3: 28672 / 8192)

    def lines(self) -> list[str]:
        return [f"matmuls reach {self.compute_efficiency:.0%} of peak FLOP/s and weight reads "
                f"{self.memory_efficiency:.0%} of peak memory bandwidth",
                f"{self.layer_overhead_s * 1e3:.2f} ms of launch overhead per layer per forward on a GPU "
                f"({self.cpu_layer_overhead_s * 1e3:.2f} ms on a CPU)",
                f"device reserve {self.device_reserve_bytes / 1e9:.0f} GB besides the activations, host reserve "
                f"{self.host_reserve_bytes / 1e9:.0f} GB, KV cache for {self.context} tokens and the largest tree "
                f"({self.kv_heads} KV heads x {self.head_dim})",
                "streaming overlaps compute perfectly (a pass costs the slower of the two); streamed layers come from "
                "pinned RAM, or from the SSD at its read speed when RAM is full",
                "the draft stays resident in the compute dtype (bfloat16 on a GPU, float32 on a CPU), the LM head on "
                "the device"]


def parse_params(text: str) -> float:
    """'70B', '7.5b', '500M', '1.5e9' -> parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not match:
        raise OffspecError(f"cannot read a parameter count from {text!r}; write e.g. 70B, 8B or 500M")
    value = float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match[2]]
    if value < 1e6:
        raise OffspecError(f"parameter count {text!r} is implausibly small; write e.g. 70B, 8B or 500M")
    return value


def parse_bytes(text: str, what: str = "--ram") -> float:
    """'64GB', '64G', '512GiB', '1e11' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if not match:
        raise OffspecError(f"cannot read {what} {text!r}; write e.g. 64GB")
    base = 1024 if match[3] else 1000
    return float(match[1]) * base ** " kmgt".index(match[2] or " ")


def shape_of(params: float) -> tuple[int, int]:
    """(layers, hidden) of a dense decoder of `params` parameters, interpolated from common models."""
    x = math.log(params)
    pts = [(math.log(p), layers, hidden) for p, layers, hidden in SHAPES]
    if x <= pts[0][0]:
        return pts[0][1], pts[0][2]
    for (x0, l0, h0), (x1, l1, h1) in zip(pts, pts[1:]):
        if x <= x1:
            f = (x - x0) / (x1 - x0)
            return round(l0 + f * (l1 - l0)), round(h0 + f * (h1 - h0))
    return pts[-1][1], pts[-1][2]


@dataclass(frozen=True)
class Projection:
    plan: Plan
    placement: dict  # bytes on the device, in RAM, on the SSD; pass times
    assumptions: tuple[str, ...]
    acceptance_source: str


def _need(hw: dict, name: str, source: str) -> float:
    value = hw.get(name)
    if not value:
        raise OffspecError(f"hardware profile {source}: field hardware.{name} is needed for a projection")
    return float(value)


def project(hw: dict, target_params: float, quant: str, draft_params: float, acceptance: AcceptanceCurve,
            acceptance_source: str, source: str = "hardware profile", ram_bytes: Optional[float] = None,
            assume: Assumptions = Assumptions(), self_type: Optional[str] = None) -> Projection:
    """`self_type` ("Q2_K", "Q3_K"): the draft is made from the target (`--draft self`; `draft_params` is then the
    target's), placed as offspec places it: where the target streams, its resident layers are the draft's own and
    the draft holds its copies of the others; where the target fits whole beside the whole copy, the copy."""
    if quant not in BYTES_PER_PARAM:
        raise OffspecError(f"unknown quant {quant!r}; use {', '.join(BYTES_PER_PARAM)}")
    if self_type is not None and self_type not in SELF_BYTES_PER_PARAM:
        raise OffspecError(f"a self draft is one of {', '.join(SELF_BYTES_PER_PARAM)}, not {self_type!r}")
    gpu = hw["device_type"] == "cuda"
    flops = _need(hw, "device_flops", source) * assume.compute_efficiency
    mem_bw = _need(hw, "device_memory_bandwidth", source) * assume.memory_efficiency
    disk = _need(hw, "disk_read_bytes_per_s", source)
    link = _need(hw, "h2d_pinned_bytes_per_s", source) if gpu else math.inf
    host_ram = float(ram_bytes if ram_bytes is not None else hw["host_ram_bytes"])
    layers, hidden = shape_of(target_params)
    if self_type is not None:
        draft_params = target_params
    d_layers, d_hidden = shape_of(draft_params)
    overhead = assume.layer_overhead_s if gpu else assume.cpu_layer_overhead_s

    dense = BYTES_PER_PARAM["none"] if gpu else CPU_DENSE_BYTES
    weights = target_params * (BYTES_PER_PARAM[quant] if quant != "none" else dense)
    draft_bytes = draft_params * (dense if self_type is None else SELF_BYTES_PER_PARAM[self_type])
    device_mem = float(hw["device_memory_bytes"]) if gpu else host_ram - assume.host_reserve_bytes
    # activations per tree token: hidden states, q/k/v/o and MLP intermediates in the compute dtype, attention's
    # float32 running state (offspec/offload/estimates.py, no materialized scores)
    per_token = (6 + 3 * assume.inter_ratio) * hidden * dense + hidden * 4

    def placed(max_budget: int) -> tuple[float, float, float, float, float, float, float]:
        """(KV cache + activations, resident, in RAM, on SSD, stream seconds per pass, the draft's bytes resident,
        the bytes a draft step reads) for trees of max_budget."""
        kv = 2 * layers * assume.kv_heads * assume.head_dim * dense * (assume.context + max_budget)
        headroom = kv + (per_token * (max_budget + 1) + assume.device_reserve_bytes if gpu else 0.0)
        room = device_mem - draft_bytes - headroom
        if room < 0:
            what = "draft" if self_type is None else f"{self_type} copy of the target (the self draft)"
            raise OffspecError(f"the {what} ({draft_bytes / 1e9:.1f} GB) and the KV cache "
                               f"({headroom / 1e9:.1f} GB with the activations) do not fit in "
                               f"{device_mem / 1e9:.1f} GB of {'device memory' if gpu else 'RAM'}; use a smaller "
                               f"draft")
        resident, held, reads = min(weights, room), draft_bytes, draft_bytes
        if self_type is not None and room < weights:  # the target streams: its resident layers are the draft's own
            share = draft_bytes / weights  # copy bytes per target byte: a resident byte lets `share` of the copy go
            if share >= 1:
                raise OffspecError(f"a {self_type} copy of a {quant} target is no smaller than the target; use "
                                   f"--draft-params N (a draft model)")
            resident = min(weights, room / (1 - share))  # resident + share * (weights - resident) <= room + copy
            held = draft_bytes * (1 - resident / weights)
            reads = resident + held
        rest = weights - resident
        in_ram = min(rest, max(0.0, host_ram - assume.host_reserve_bytes)) if gpu else 0.0
        on_ssd = rest - in_ram
        return headroom, resident, in_ram, on_ssd, in_ram / link + on_ssd / min(disk, link), held, reads

    max_budget = assume.max_budget or MAX_BUDGET
    if gpu and assume.max_budget is None:  # what the card computes usefully, with the room that leaves
        for _ in range(8):  # a smaller tree leaves more layers resident: a shorter floor, maybe a smaller tree
            stream = placed(max_budget)[4]
            smaller = compute_budget(target_params, flops, max(stream, weights / mem_bw), ceiling=max_budget)
            if smaller == max_budget:
                break
            max_budget = smaller
    headroom, resident, in_ram, on_ssd, stream, draft_held, draft_reads = placed(max_budget)

    def target_pass(n: int) -> float:
        compute = max(2 * target_params * n / flops, weights / mem_bw)
        return max(stream, compute) + layers * overhead

    def draft_step(k: int) -> float:
        return max(2 * draft_params * k / flops, draft_reads / mem_bw) + d_layers * overhead

    sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, max_budget + 1})
    head = dense * hidden * assume.vocab / mem_bw  # one LM-head read per walk position
    costs = PairCosts(target_pass=CostCurve.of([(n, target_pass(n)) for n in sizes]), target_head=head,
                      draft_step=CostCurve.of([(k, draft_step(k)) for k in sizes if k <= 512]), expand_ratio=1.0)
    result = plan(costs, acceptance, PlannerConfig(max_budget=max_budget))
    placement = {"target_bytes": weights, "draft_bytes": draft_held, "device_bytes": resident, "ram_bytes": in_ram, "ssd_bytes": on_ssd,
                 "stream_seconds_per_pass": stream, "target_layers": layers, "draft_layers": d_layers,
                 "one_token_pass_seconds": target_pass(1), "max_budget": max_budget, "headroom_bytes": headroom}
    assumptions = tuple(assume.lines()) + (
        f"target {target_params / 1e9:.3g}B params ({layers} layers, hidden {hidden}) in "
        f"{quant if quant != 'none' else ('bfloat16' if gpu else 'float32')}: "
        f"{weights / 1e9:.1f} GB; " + (f"draft {draft_params / 1e9:.3g}B params in {'16' if gpu else '32'}-bit "
                                       f"({d_layers} layers)" if self_type is None else
                                       f"draft the target itself: its resident layers as they are and its own "
                                       f"{self_type} copy of the others ({draft_held / 1e9:.1f} GB, resident), as "
                                       f"offspec places a self draft (a target that fits whole beside the whole "
                                       f"copy drafts with the copy)"),
        f"acceptance curve: {acceptance_source}",
        f"largest tree {max_budget} nodes" + (" (what the card computes within twice a one-token pass's floor)"
                                             if gpu and assume.max_budget is None else ""),
    )
    return Projection(result, placement, assumptions, acceptance_source)
