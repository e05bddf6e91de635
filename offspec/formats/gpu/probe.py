"""Whether offspec's Triton kernels run on this card, found once, before the first pass: every kernel configuration
a model's passes can launch, launched on tiny inputs.

Triton compiles a kernel at its first launch and checks it against the card there (shared memory, registers:
`OutOfResources`; a compile or assembler error). Without this, the first pass of some size that needs a new
configuration (a long prefill, a big tree while the budget is chosen) would stop with a traceback. `probe` launches
each configuration the engine can: the linears' three tilings (linear.py: 16 rows with the K splits as programs,
64 rows likewise, 64 rows with the splits in each program), with and without a bias, for each weight type, input
width and output width class a model holds; the decode of its token table; the norms, the rotary embedding and the
attention of its layer geometry; a mixture's grouped expert launches (experts.py) at both row tilings, where its
experts are on the card. The compiled kernels stay in Triton's caches, so the passes that follow find them.

A failure names the configuration and Triton's reason in one line; `check_models` then falls back to torch's path
(choice.fall_back) and returns the line that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from .launch import card

PROBE_ROWS = 64  # weight rows of a probe linear: one tile of every tiling, and K splits on any card


@dataclass(frozen=True)
class LinearCase:
    """What a linear's compiled kernel depends on besides the tiling: the type, the input width (K and the rows'
    byte stride), whether the output width is a multiple of 16 (Triton specializes its row stride) and the bias."""

    type_id: int
    cols: int
    wide16: bool
    bias: bool


@dataclass(frozen=True)
class ExpertCase:
    """A grouped expert launch (experts.py): the type, input width, weight rows, parts (2: gate and up) and bias."""

    type_id: int
    cols: int
    rows: int
    parts: int
    bias: bool


@dataclass(frozen=True)
class LayerCase:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def model_cases(model: Any, layers_installed: bool) -> tuple[set[LinearCase], set[tuple[int, int]], set[LayerCase]]:
    """(linear cases, (type, cols) of its token tables, layer geometries) of a loaded model: each QLinear alone (the
    head, transformers' layers), and, where offspec's CUDA layers run it, the groups layer.py launches."""
    from ..modules import QEmbedding, QLinear
    from .support import PROJECTIONS

    linears: set[LinearCase] = set()
    for module in model.modules():
        if isinstance(module, QLinear):
            linears.add(LinearCase(module.type_id, module.in_features, module.out_features % 16 == 0,
                                   module.bias is not None))
    tables = {(m.type_id, m.embedding_dim) for m in model.modules() if isinstance(m, QEmbedding)}
    layers: set[LayerCase] = set()
    if layers_installed:
        config = model.config
        for layer in model.get_decoder().layers:
            q, k, v, o, gate, up, down = (layer.get_submodule(name) for name in PROJECTIONS)
            bias = any(p.bias is not None for p in (q, k, v))
            for group, has_bias in (((q, k, v), bias), ((o,), False), ((gate, up), False), ((down,), False)):
                wide = sum(p.out_features for p in group) % 16 == 0
                for p in group:
                    linears.add(LinearCase(p.type_id, p.in_features, wide, has_bias))
            layers.add(LayerCase(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                 layer.self_attn.head_dim))
    return linears, tables, layers


def expert_cases(model: Any, device: torch.device) -> set[ExpertCase]:
    """The grouped launches a mixture's experts on `device` take (experts.layer_ffn): gate and up together where they
    have one type and shape, else each alone; down. Experts kept elsewhere (host memory: read as routed) run no
    grouped launch."""
    from ..experts import QExperts

    cases: set[ExpertCase] = set()
    for block in model.modules():
        if not isinstance(block, QExperts) or not len(block):
            continue
        if block.experts[0].gate_proj.qweight.device.type != device.type:
            continue
        gate, up, down = block.experts[0].gate_proj, block.experts[0].up_proj, block.experts[0].down_proj
        bias = block.swiglu is not None
        if gate.type_id == up.type_id and gate.qweight.shape == up.qweight.shape:
            cases.add(ExpertCase(gate.type_id, gate.in_features, gate.out_features, 2, bias))
        else:
            cases |= {ExpertCase(m.type_id, m.in_features, m.out_features, 1, bias) for m in (gate, up)}
        cases.add(ExpertCase(down.type_id, down.in_features, down.out_features, 1, bias))
    return cases


def probe(device: torch.device, dtype: torch.dtype, linears: Iterable[LinearCase],
          tables: Iterable[tuple[int, int]] = (), layers: Iterable[LayerCase] = (),
          experts: Iterable[ExpertCase] = ()) -> Optional[str]:
    """None when every configuration launched and ran, else one line: which failed, and Triton's reason."""
    from triton.errors import TritonError

    for what, run in _launches(device, dtype, linears, tables, layers, experts):
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # sync: a launch error surfaces here, with its configuration
        except (TritonError, RuntimeError) as exc:
            text = str(exc).strip().splitlines()
            return f"{what} on {card(device).name}: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return None


def _launches(device, dtype, linears, tables, layers, experts=()) -> Iterator[tuple[str, Any]]:
    from ..ggml import ggml_type
    from . import experts as ge
    from . import linear as gl

    dname = str(dtype).removeprefix("torch.")
    for case in sorted(set(linears), key=repr):
        t = ggml_type(case.type_id)
        width = PROBE_ROWS if case.wide16 else PROBE_ROWS + 8  # (the output row stride, divisible by 16 or not)
        weight = torch.zeros((width, t.row_bytes(case.cols)), dtype=torch.uint8, device=device)  # (rows, bytes)
        bias = torch.zeros(width, dtype=dtype, device=device) if case.bias else None
        for rows in (1, gl.FEW_ROWS + 1, gl.GRID_SPLIT_ROWS + 1):  # the three tilings
            x = torch.zeros((rows, case.cols), dtype=dtype, device=device)  # (rows, cols)
            yield (f"the {t.name} linear of {case.cols} columns at {rows} rows ({dname}"
                   f"{', bias' if case.bias else ''})", lambda x=x, w=weight, b=bias, c=case: gl.linear(
                       x, [(w, c.type_id)], c.cols, b))
    for type_id, cols in sorted(set(tables)):
        t = ggml_type(type_id)
        table = torch.zeros((2, t.row_bytes(cols)), dtype=torch.uint8, device=device)  # (2, bytes) two rows
        yield (f"the {t.name} token table's decode", lambda r=table, i=type_id, c=cols: gl.decode(
            r, i, c, torch.float32))
    for case in sorted(set(experts), key=repr):
        t = ggml_type(case.type_id)
        weight = torch.zeros((case.rows, t.row_bytes(case.cols)), dtype=torch.uint8, device=device)  # (N, bytes)
        bias = torch.zeros(case.rows, dtype=dtype, device=device) if case.bias else None
        for rows in (1, gl.FEW_ROWS + 1):  # both row tiles (Tiles.bm), two experts
            x = torch.zeros((rows + 1, case.cols), dtype=dtype, device=device)  # (rows + 1, cols)
            yield (f"the grouped {t.name} experts of {case.cols} columns, {case.parts} part(s), at {rows} rows "
                   f"({dname}{', bias' if case.bias else ''})", lambda x=x, w=weight, b=bias, c=case, r=rows:
                   ge.grouped_linear(x, [r, 1], [[w, w]] * c.parts, c.type_id, c.cols,
                                     None if b is None else [[b, b]] * c.parts))
    for geometry in sorted(set(layers), key=repr):
        yield (f"the layer kernels of {geometry.heads} heads of {geometry.head_dim} ({geometry.kv_heads} KV), "
               f"width {geometry.hidden} ({dname})", lambda g=geometry: _layer_kernels(g, device, dtype))


def _layer_kernels(g: LayerCase, device: torch.device, dtype: torch.dtype) -> None:
    """The norms (with and without the residual add), the rotary embedding with the cache write and the tree
    attention (both its parts) of one layer geometry, at a few rows over a short cache."""
    from .attention import BLOCK_N, TailKeys, attend
    from .norm import add_rms_norm, rope_kv

    rows, prefix = 3, BLOCK_N + 1  # a whole chunk of prefix (the prefix part runs) and a partial one
    h = torch.zeros((rows, g.hidden), dtype=dtype, device=device)  # (rows, E)
    weight = torch.ones(g.hidden, dtype=dtype, device=device)
    add_rms_norm(h, None, weight, 1e-6)
    add_rms_norm(h, h, weight, 1e-6)
    qkv = torch.zeros((rows, (g.heads + 2 * g.kv_heads) * g.head_dim), dtype=dtype, device=device)
    cos = torch.ones((rows, g.head_dim), dtype=dtype, device=device)  # (rows, D)
    k_cache = torch.zeros((g.kv_heads, prefix + rows, g.head_dim), dtype=dtype, device=device)  # (Hkv, cap, D)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(prefix, prefix + rows, device=device)
    queries = rope_kv(qkv, cos, cos, slots, k_cache, v_cache, g.heads, g.kv_heads)  # (rows, H, D)
    visible = torch.ones((rows, prefix + rows), dtype=torch.bool, device=device)
    attend(queries, k_cache, v_cache, TailKeys.of(visible, prefix), g.head_dim ** -0.5)


def check_models(device: torch.device, dtype: torch.dtype, models: Iterable[Any]) -> Optional[str]:
    """Probe every configuration these models' passes can launch (their layers' where offspec's CUDA layers run
    them); where one fails, fall back to torch's path for this process (choice.fall_back: an error under
    OFFSPEC_CUDA_KERNELS=triton) and return the line that says so. None: the kernels run here."""
    from .choice import fall_back
    from .support import cuda_layers

    linears: set[LinearCase] = set()
    tables: set[tuple[int, int]] = set()
    layers: set[LayerCase] = set()
    experts: set[ExpertCase] = set()
    for model in models:  # (whether offspec's CUDA layers would run it: a question about CUDA, whatever `device`)
        cases = model_cases(model, cuda_layers(model, torch.device("cuda"), dtype) is None)
        linears |= cases[0]
        tables |= cases[1]
        layers |= cases[2]
        experts |= expert_cases(model, device)
    reason = probe(device, dtype, linears, tables, layers, experts)
    return None if reason is None else fall_back(reason)
