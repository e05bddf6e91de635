"""Mixture-of-experts layers on ggml blocks: the router and the experts of qwen3moe, qwen2moe, gpt-oss and Mixtral.

transformers keeps a layer's experts as two stacked float tensors (`gate_up_proj` (experts, 2 * inter, hidden),
`down_proj` (experts, hidden, inter)) and routes with a float `F.linear`. offspec keeps the GGUF's blocks:
- `QExperts` holds one `QExpert` per expert, its gate, up and down projections `QLinear`s of the file's types, so
  each expert's blocks are stored together (`mlp.experts.<e>.{gate,up,down}_proj.qweight`) and one read of a layer
  payload's range fetches one expert; on a CPU with offspec's kernels, the routed experts run in one compiled call
  (`csrc/experts.h: experts_ffn`), else one torch step at a time, the same operations in the same order;
- `QRouter` is a `QLinear` of the router's F32 rows (llama.cpp keeps routers F32) whose forward routes as
  transformers' top-k routers do: a softmax over the experts, the top k, renormalized where the family does; or,
  for gpt-oss, a bias added, the top k of the logits, and a softmax over those k;
- gpt-oss's experts have biases on all three projections and a clamped SwiGLU: (clamp(up, -l, l) + 1) *
  g * sigmoid(alpha g) with g = min(gate, l) (`QExperts.swiglu`, transformers' GptOssExperts._apply_gate).

Exactness: the router's F32 rows multiply in float, row by row (qgemm's float path), each expert's projections
are the row-invariant kernels, and a token sums its experts' outputs in ascending expert order whatever else is in
the pass (as transformers' loop does). So a token's output has the same bits whether 1 or 40 tokens are routed
with it: a tree node equals the token decoded alone. One more step needs care: qwen2moe's shared expert is scaled by
the sigmoid of a (T, 1) gate, and torch's sigmoid gives some values other bits in a large tensor than alone (6 of
300 rows here); `invariant_sigmoid` computes 1 / (1 + exp(-x)) with each row spread over a whole vector of its own.

`replace_moe(layer, ...)` swaps them into a weightless transformers layer; `moe_paths(names)` and `expert_groups`
find, from a layer's stored tensor names, where its experts live and how the store lays them out;
`QExperts.read_as_routed` makes a layer fetch its routed experts from an expert cache (offspec/offload/experts.py)
at each call; `expert_use(model)` summarizes how the routing spread over the experts.
"""

from __future__ import annotations

import re
import types
from typing import Optional

import torch
from torch import nn

from . import kernels
from .modules import QLinear

_ACTIVATIONS = {"SiLUActivation": 0, "SiLU": 0, "PytorchGELUTanh": 1, "GELUTanh": 1}  # csrc/layer.h's Activation
_SWIGLU_OAI = 2  # csrc/layer.h's Activation for gpt-oss's clamped SwiGLU (csrc/experts.h: swiglu_oai)
EXPERT_NAME = re.compile(r"^(?P<owner>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.qweight$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's stored order: one expert's blocks together


class QRouter(QLinear):
    """A top-k router: logits = x W^T on W's F32 (or low-bit) rows, then transformers' routing; its forward returns
    (logits (T, E), weights (T, k), experts (T, k)) as transformers' routers do."""

    def __init__(self, type_id: int, hidden: int, experts: int, top_k: int, normalize: bool, device: torch.device,
                 bias: bool = False, topk_first: bool = False):
        super().__init__(type_id, hidden, experts, bias, device)
        self.top_k, self.normalize = top_k, normalize
        self.topk_first = topk_first  # gpt-oss: the softmax over the top k logits, not over all the experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = super().forward(x.reshape(-1, self.in_features))  # (T, E)
        if self.topk_first:
            top, experts = torch.topk(logits, self.top_k, dim=-1)  # (T, k) each
            return logits, torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts

    def extra_repr(self) -> str:
        order = ", softmax of the top k" if self.topk_first else ""
        return f"{super().extra_repr()}, top_k={self.top_k}, normalize={self.normalize}{order}"


class QExpert(nn.Module):
    """One expert: down(act(gate(x)) * up(x))."""

    def __init__(self, gate: QLinear, up: QLinear, down: QLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down


class QExperts(nn.Module):
    """A layer's experts; forward(x (T, H), experts (T, k), weights (T, k)) -> (T, H), as transformers' experts."""

    def __init__(self, experts: list[QExpert], act: Optional[nn.Module], swiglu: Optional[tuple[float, float]] = None):
        super().__init__()
        if (act is None) == (swiglu is None):
            raise ValueError("QExperts takes an activation module or gpt-oss's (alpha, limit), one of them")
        self.swiglu = swiglu  # gpt-oss's clamped SwiGLU (alpha, limit), in place of act(gate) * up
        for e, expert in enumerate(experts):  # children "0", "1", ...: the stored names' "experts.<e>.gate_proj"
            self.add_module(str(e), expert)
        self.experts = tuple(experts)  # a plain tuple: not registered twice
        self.act_fn = act
        # where the experts are read as routed (offspec/offload/experts.py): an object whose fetch(experts) gives
        # {expert: (nbytes,) uint8 view of its range} and whose prefetch(x) reads ahead the next layer's, and per
        # expert its projections' (offset, nbytes) in the range; their weights are then bound for each call only
        self.stream = None
        self.layout: list[tuple[tuple[int, int], ...]] = []
        self.uses = torch.zeros(len(experts), dtype=torch.long)  # (E,) tokens routed to each expert (`expert_use`)
        # `offspec profile` only (offspec/profile/routing.py): an object whose record(self, top_k_index) sees each
        # call's (T, k) expert ids; None (always, elsewhere): nothing recorded, no output changed either way
        self.recorder = None

    def read_as_routed(self, stream, layout: list[tuple[tuple[int, int], ...]]) -> None:
        """Read the experts through `stream` from now on (`layout`: per expert, its gate, up and down (offset,
        nbytes) in its range)."""
        self.stream, self.layout = stream, layout

    def _bind(self, views: dict[int, torch.Tensor]) -> list[tuple[QLinear, torch.Tensor]]:
        """Bind the fetched experts' weights to their views; returns what to put back."""
        held = []
        for e, view in views.items():
            expert = self.experts[e]
            for linear, (offset, nbytes) in zip((expert.gate_proj, expert.up_proj, expert.down_proj), self.layout[e]):
                shape = linear._buffers["qweight"].shape
                held.append((linear, linear._buffers["qweight"]))
                linear._buffers["qweight"] = view[offset : offset + nbytes].view(shape)
        return held

    def __len__(self) -> int:
        return len(self.experts)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.record(self, top_k_index)
        counts = torch.bincount(top_k_index.reshape(-1).cpu(), minlength=len(self.experts))  # (E,)
        self.uses += counts
        routed = counts.nonzero().reshape(-1).tolist()  # CPU sync: the experts that run, ascending
        held = self._bind(self.stream.fetch(routed)) if self.stream is not None else []
        if self.stream is not None:
            self.stream.prefetch(x)  # the next layer's experts, read while these compute
        try:
            if x.device.type == "cuda" and routed and kernels.cuda_kernels() == "triton":
                from .gpu.experts import layer_ffn  # imported here: a CPU never loads Triton

                out = layer_ffn(self, x, routed, counts, top_k_index, top_k_weights)  # grouped: the loop's bits
                if out is not None:
                    return out
            return self._run(x, routed, top_k_index, top_k_weights)
        finally:
            for linear, placeholder in held:  # the routed experts' views go: the cache may reuse their slots
                linear._buffers["qweight"] = placeholder

    def _run(self, x: torch.Tensor, routed: list[int], top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
        """(T, H): each token's experts' outputs times their weights, added in ascending expert order."""
        ext = kernels.compiled() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        act = _ACTIVATIONS.get(type(self.act_fn).__name__) if self.swiglu is None else _SWIGLU_OAI
        if ext is not None and act is not None:  # the routed experts in one call (csrc/experts.h), the same bits
            trios = [(self.experts[e].gate_proj, self.experts[e].up_proj, self.experts[e].down_proj) for e in routed]
            biases = [m.bias.detach() for t in trios for m in t] if self.swiglu is not None else []
            alpha, limit = self.swiglu or (0.0, 0.0)
            return ext.experts_ffn(x.contiguous(), top_k_index, top_k_weights, torch.tensor(routed),
                                   [g.qweight for g, _, _ in trios], [u.qweight for _, u, _ in trios],
                                   [d.qweight for _, _, d in trios], [m.kernel_type for t in trios for m in t], act,
                                   biases, alpha, limit)
        out = torch.zeros_like(x)  # (T, H)
        for e in routed:  # ascending: a token adds its experts in the same order in any pass
            tokens, slots = (top_k_index == e).nonzero(as_tuple=True)  # (n,) each: token order
            expert = self.experts[e]
            rows = x[tokens]  # (n, H)
            y = expert.down_proj(self._glu(expert.gate_proj(rows), expert.up_proj(rows)))  # (n, H)
            out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None].to(y.dtype))
        return out

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, or gpt-oss's clamped SwiGLU (each value from its own gate and up: rows independent)."""
        if self.swiglu is None:
            return self.act_fn(gate) * up
        alpha, limit = self.swiglu
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def extra_repr(self) -> str:
        return f"{len(self.experts)} experts" + (f", clamped SwiGLU {self.swiglu}" if self.swiglu else "")


_LANES = 16  # floats in an AVX-512 vector (two AVX2 ones): a row this wide is computed whole in vector lanes


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of a (T, 1) tensor, each row's bits its own: the row spread over a whole vector (see the module)."""
    wide = x.expand(-1, _LANES).contiguous()  # (T, 16)
    return (1.0 / (1.0 + torch.exp(-wide)))[:, :1]  # (T, 1)


def shared_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2MoeSparseMoeBlock's forward (routed experts plus a shared expert scaled by its sigmoid gate), with
    `invariant_sigmoid`."""
    batch, seq, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)  # (T, H)
    shared = block.shared_expert(x)  # (T, H)
    _, weights, experts = block.gate(x)
    routed = block.experts(x, experts, weights)  # (T, H)
    out = routed + invariant_sigmoid(block.shared_expert_gate(x)) * shared
    return out.reshape(batch, seq, hidden)


def expert_use(model: nn.Module) -> Optional[dict]:
    """How a mixture's routing spreads over its experts since it was loaded (every token of every pass, prompts
    included): the experts used, and how many of the most used ones (and their bytes) take 50, 90 and 99% of the
    routings. None for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, QExperts)]
    if not blocks:
        return None
    counts = torch.cat([b.uses for b in blocks])  # (layers * E,)
    total = int(counts.sum())
    ranked = counts.sort(descending=True).values.double()
    share = ranked.cumsum(0) / max(total, 1)  # (layers * E,) the routings the n most used take
    first = blocks[0].experts[0]
    per_expert = sum(int(torch.Size(m.qweight.shape).numel()) for m in (first.gate_proj, first.up_proj,
                                                                        first.down_proj))
    out = {"routings": total, "experts": int(counts.numel()), "used": int((counts > 0).sum()),
           "expert_bytes": per_expert}
    for pct in (50, 90, 99):
        n = int((share < pct / 100).sum()) + 1 if total else 0
        out[f"hot_{pct}"], out[f"hot_{pct}_bytes"] = n, n * per_expert
    return out


def moe_paths(names: list[str]) -> dict[str, dict[int, dict[str, str]]]:
    """{experts module path: {expert: {projection: stored name}}} of a layer's stored tensor names."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        m = EXPERT_NAME.match(name)
        if m:
            out.setdefault(m["owner"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
    return out


def expert_groups(names: list[str]) -> list[list[str]]:
    """A layer's experts as groups of stored names read apart (offspec.store.packed.plan_layer's `groups`): each
    expert's gate, up and down, expert by expert; [] for a dense layer."""
    return [[stored[proj] for proj in PROJECTIONS] for _, experts in sorted(moe_paths(names).items())
            for _, stored in sorted(experts.items())]


def _router_attr(block: nn.Module) -> str:
    """The attribute of a sparse block that holds its router: `gate` (qwen, Mixtral) or `router` (gpt-oss)."""
    return "router" if hasattr(block, "router") else "gate"


def _routing(config, block: nn.Module) -> tuple[int, bool]:
    """(top k, renormalized) of a sparse block's router, as transformers' router of `config` routes."""
    router = getattr(block, _router_attr(block))
    top_k = int(getattr(router, "top_k", 0) or config.num_experts_per_tok)
    normalize = getattr(router, "norm_topk_prob", None)
    if normalize is None:  # Mixtral's router always renormalizes
        normalize = type(router).__name__.startswith("Mixtral")
    return top_k, bool(normalize)


def replace_moe(layer: nn.Module, config, stored: dict[str, tuple[int, int, int]], device: torch.device,
                router_type: Optional[int], biased: bool = False) -> None:
    """Swap `layer`'s experts and router for QExperts / QRouter, empty, of the stored types: `stored` maps a stored
    expert tensor name to (ggml type, rows, cols); `router_type` the router's ggml type (None: no stored router);
    `biased`: the projections and the router have biases (gpt-oss)."""
    for owner, experts in moe_paths(list(stored)).items():
        block_path = owner.rpartition(".")[0]
        block = layer.get_submodule(block_path)
        old = block.experts
        made = []
        for e in range(len(experts)):
            if e not in experts or set(experts[e]) != set(PROJECTIONS):
                raise ValueError(f"{owner}: expert {e} is not stored whole")
            linears = []
            for proj in PROJECTIONS:
                type_id, rows, cols = stored[experts[e][proj]]
                linears.append(QLinear(type_id, cols, rows, biased, device))
            made.append(QExpert(*linears))
        num = getattr(old, "num_experts", None) or getattr(config, "num_experts", None) or \
            getattr(config, "num_local_experts")
        if len(made) != num:
            raise ValueError(f"{owner}: {len(made)} experts stored, the config has {num}")
        top_k, normalize = _routing(config, block)
        gpt_oss = type(old).__name__ == "GptOssExperts"
        if gpt_oss != biased:
            raise ValueError(f"{owner}: {type(old).__name__} with{'out' if not biased else ''} stored biases")
        block.experts = (QExperts(made, None, (float(old.alpha), float(old.limit))) if gpt_oss
                         else QExperts(made, old.act_fn))
        if hasattr(block, "shared_expert_gate"):
            if type(block).__name__ != "Qwen2MoeSparseMoeBlock":
                raise ValueError(f"{block_path}: a shared expert offspec does not know ({type(block).__name__})")
            block.forward = types.MethodType(shared_block_forward, block)
        if router_type is not None:
            hidden = made[0].gate_proj.in_features
            setattr(block, _router_attr(block), QRouter(router_type, hidden, len(made), top_k, normalize, device,
                                                         bias=gpt_oss, topk_first=gpt_oss))
