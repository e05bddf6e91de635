"""Shape twins for scripts/gpu_check.py: decoder-layer stacks with the shapes and ggml type mix of real models and
random valid blocks, written on the GPU itself (no download; a 4-layer Llama-3-70B slice is 2.2 GB of blocks).

- `SHAPES`: the default pair's (Qwen2.5-1.5B target, Qwen2.5-0.5B draft) and a 4-layer Llama-3-70B slice, with a
  Q4_K_M-like type mix (the 0.5B's 896-wide rows take Q5_0 / Q8_0, as llama.cpp falls back to).
- `random_weight`: (rows, row_bytes) blocks of any type with small positive fp16 scales (MXFP4: exponents of
  such scales; finite values).
- `Stack`: resident layers (offspec.formats.gpu.layer.decoder_layer) with KV caches holding a random prefix.
- `StreamedSlice`: the layers' payloads in pinned host RAM, streamed through offspec's LayerStreamer.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.tiny_gguf import HALF_FIELDS, SCALE  # noqa: E402

from offspec.formats.ggml import ggml_type  # noqa: E402
from offspec.formats.gpu.attention import TailKeys  # noqa: E402
from offspec.formats.gpu.support import PROJECTIONS  # noqa: E402
from offspec.formats.gpu.layer import Parts, decoder_layer  # noqa: E402
from offspec.formats.gpu.linear import linear  # noqa: E402
from offspec.formats.gpu.norm import add_rms_norm  # noqa: E402

HALVES = {**HALF_FIELDS, "IQ4_NL": (0,), "IQ4_XS": (0,)}
SCALES = {**SCALE, "IQ4_NL": 0.005, "IQ4_XS": 0.005}
Q4_K_M = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
          "up_proj": "Q4_K", "down_proj": "Q6_K", "head": "Q6_K"}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    types: dict = field(default_factory=lambda: dict(Q4_K_M))
    qkv_bias: bool = False

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of one layer's projections, PROJECTIONS' order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("q_proj", q, self.hidden), ("k_proj", kv, self.hidden), ("v_proj", kv, self.hidden),
                ("o_proj", self.hidden, q), ("gate_proj", self.inter, self.hidden),
                ("up_proj", self.inter, self.hidden), ("down_proj", self.hidden, self.inter)]

    def layer_bytes(self) -> int:
        return sum(rows * ggml_type(self.types[n]).row_bytes(cols) for n, rows, cols in self.linears())


SHAPES = {
    "70b": Shape("Llama-3-70B, 4 layers", 4, 8192, 64, 8, 128, 28672, 128256),
    "1.5b": Shape("Qwen2.5-1.5B (the default target)", 28, 1536, 12, 2, 128, 8960, 151936, qkv_bias=True),
    "0.5b": Shape("Qwen2.5-0.5B (the default draft)", 24, 896, 14, 2, 64, 4864, 151936,
                  {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate_proj": "Q5_0",
                   "up_proj": "Q5_0", "down_proj": "Q6_K", "head": "Q8_0"}, qkv_bias=True),
}


def random_weight(type_name: str, rows: int, cols: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """(rows, row_bytes) uint8 random valid blocks of `type_name` on `device`."""
    t = ggml_type(type_name)
    if type_name in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        values = torch.randn((rows, cols), device=device, generator=gen) * 0.08
        return values.to(dtype).view(torch.uint8).reshape(rows, -1)
    nb = cols // t.block
    raw = torch.randint(0, 256, (rows, nb, t.nbytes), dtype=torch.uint8, device=device, generator=gen)
    for i, off in enumerate(HALVES[type_name]):
        scale = SCALES[type_name] * (1.0 if i == 0 else 0.5)
        halves = ((torch.rand((rows, nb), device=device, generator=gen) + 0.5) * scale).half()  # (rows, nb)
        raw[:, :, off : off + 2] = halves.view(torch.uint8).reshape(rows, nb, 2)
    if type_name == "MXFP4":  # E8M0 exponents: 2**(e - 128) within a factor 2 of SCALE (random_blocks' choice)
        centre = 128 + round(math.log2(SCALES[type_name]))
        raw[:, :, 0] = torch.randint(centre - 1, centre + 2, (rows, nb), device=device, generator=gen).to(torch.uint8)
    return raw.reshape(rows, -1)


def rope(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, base: float = 10000.0):
    """(cos, sin), (n, head_dim) each, as transformers' default rotary embedding computes them."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv[None, :]  # (n, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (n, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def parts_of(shape: Shape, views: dict, index: int) -> Parts:
    """A layer's Parts over tensors named like a packed layer's ("self_attn.q_proj.qweight", ...)."""
    projections = []
    for (name, rows, cols), path in zip(shape.linears(), PROJECTIONS):
        bias = views.get(f"{path}.bias")
        projections.append(SimpleNamespace(qweight=views[f"{path}.qweight"], type_id=ggml_type(shape.types[name]).id,
                                           in_features=cols, out_features=rows, bias=bias))
    norms = (SimpleNamespace(weight=views["input_layernorm.weight"]),
             SimpleNamespace(weight=views["post_attention_layernorm.weight"]))
    return Parts(tuple(projections), norms, 1e-6, shape.heads, shape.kv_heads, shape.head_dim,
                 shape.head_dim ** -0.5, index)


def layer_tensors(shape: Shape, device: torch.device, gen: torch.Generator, dtype: torch.dtype) -> dict:
    """One layer's random tensors by packed name (blocks as uint8, norms and biases in `dtype`)."""
    out = {}
    for (name, rows, cols), path in zip(shape.linears(), PROJECTIONS):
        out[f"{path}.qweight"] = random_weight(shape.types[name], rows, cols, device, gen)
        if shape.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
            out[f"{path}.bias"] = (torch.randn(rows, device=device, generator=gen) * 0.1).to(dtype)
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[norm] = (1.0 + 0.05 * torch.randn(shape.hidden, device=device, generator=gen)).to(dtype)
    return out


class Stack:
    """`shape`'s layers resident on `device` (or only their caches, for a streamed slice), caches of `capacity`
    slots whose first `prefix` hold random keys and values, the final norm and (head=True) the LM head."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16, prefix: int = 512,
                 capacity: int = 2048, resident: bool = True, head: bool = True, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.device, self.dtype, self.prefix = shape, device, dtype, prefix
        self.layers = [parts_of(shape, layer_tensors(shape, device, gen, dtype), i) for i in range(shape.layers)] \
            if resident else []
        cache = (shape.kv_heads, capacity, shape.head_dim)
        self.k = [(torch.randn(cache, device=device, generator=gen) * 0.5).to(dtype) for _ in range(shape.layers)]
        self.v = [(torch.randn(cache, device=device, generator=gen) * 0.5).to(dtype) for _ in range(shape.layers)]
        self.norm = (1.0 + 0.05 * torch.randn(shape.hidden, device=device, generator=gen)).to(dtype)
        self.head = random_weight(shape.types["head"], shape.vocab, shape.hidden, device, gen) if head else None
        self.gen = gen

    def inputs(self, n: int, tree: bool = True):
        """(h, cos, sin, slots, keys) of an n-token pass above the prefix: a random tree (tree=True) or n tokens
        decoded in a causal chunk."""
        device, p = self.device, self.prefix
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i)).item())
                          for i in range(1, n)] if tree else list(range(-1, n - 1))
        depth = [0] * n
        visible = torch.zeros((n, p + n), dtype=torch.bool)  # (n, p + n)
        visible[:, :p] = True
        for i, parent in enumerate(parents):
            if parent >= 0:
                visible[i] = visible[parent]
                depth[i] = depth[parent] + 1
            visible[i, p + i] = True
        positions = torch.tensor(depth, device=device) + p
        cos, sin = rope(positions, self.shape.head_dim, self.dtype)
        h = (torch.randn((n, self.shape.hidden), device=device, generator=self.gen) * 0.5).to(self.dtype)
        slots = torch.arange(p, p + n, device=device)
        return h, cos, sin, slots, TailKeys.of(visible.to(device), p)

    def layer(self, i: int, parts: Parts, h, cos, sin, slots, keys) -> torch.Tensor:
        return decoder_layer(h, parts, cos, sin, self.k[i], self.v[i], slots, keys)

    def run(self, h, cos, sin, slots, prefix, gather, count, head_rows: bool = False):
        """The resident stack, the final norm, and (head_rows) the head's logits and their top 8 (a draft step)."""
        keys = TailKeys(prefix, gather, count)
        for i, parts in enumerate(self.layers):
            h = self.layer(i, parts, h, cos, sin, slots, keys)
        h = add_rms_norm(h, None, self.norm, 1e-6)[1]
        if not head_rows:
            return h
        logits = linear(h, [(self.head, ggml_type(self.shape.types["head"]).id)], self.shape.hidden)
        return torch.topk(logits, 8, dim=-1).values  # (n, 8)


class StreamedSlice:
    """`shape`'s layers in pinned host RAM (written from the GPU's random blocks), streamed by LayerStreamer."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 ring_slots: int = 2):
        from offspec.offload.hostmem import host_buffer
        from offspec.offload.streamer import LayerSource, LayerStreamer
        from offspec.store.packed import plan_layer

        gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.shape, self.device = shape, device
        self.specs, sources = [], []
        for i in range(shape.layers):
            tensors = layer_tensors(shape, device, gen, dtype)
            entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
            spec = plan_layer(i, entries)
            ram = host_buffer(spec.nbytes, pin=device.type == "cuda", device=device)  # (nbytes,) page-locked
            for t, (name, tensor) in zip(spec.tensors, tensors.items()):
                ram[t.offset : t.offset + t.nbytes].copy_(tensor.reshape(-1).view(torch.uint8).cpu())
            self.specs.append(spec)
            sources.append(LayerSource(i, spec, ram=ram))
        self.bytes_per_pass = sum(s.nbytes for s in self.specs)
        self.streamer = LayerStreamer(device, sources, ring_slots=ring_slots)

    def run(self, stack: Stack, h, cos, sin, slots, keys) -> torch.Tensor:
        """One pass: each layer acquired from the ring, computed on views into its slot, released."""
        from offspec.store.packed import tensor_views

        for i, spec in enumerate(self.specs):
            payload = self.streamer.acquire(i)
            parts = parts_of(self.shape, tensor_views(payload, spec), i)
            h = stack.layer(i, parts, h, cos, sin, slots, keys)
            self.streamer.release(i)
        return h

    def close(self) -> None:
        self.streamer.close()


def time_ms(fn, device: torch.device, repeats: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn() between CUDA events on the compute stream (each run synchronized)."""
    for _ in range(warmup):
        fn()
    times = []
    stream = torch.cuda.current_stream(device)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()  # sync: the timing of this run
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def free_cuda(*objects: Optional[object]) -> None:
    """Drop references and give cached device memory back between sections."""
    del objects
    torch.cuda.empty_cache()
