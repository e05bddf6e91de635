"""Checks of offspec's CUDA decoder layer (offspec/formats/gpu/layer.py) on a tiny llama-family layer, run by
tests/helpers/gpu_interp.py (Triton's interpreter on a CPU) or directly on a GPU (tests/test_cuda_layer.py).

- `hf`: the layer against transformers' own (eager attention, the same decoded weights) over a prefill pass and a
  tree pass; their outputs and the cache entries they write, relative error. In bfloat16 both are also measured
  against transformers' layer in float32 on the same bfloat16 weights and inputs (`*_ours`, `*_theirs`): offspec's
  layer should be no further from it than transformers' bfloat16 layer is.
- `graphs`: trees of 3 and 5 nodes through graphs.run_bucketed (padded to 4 and 8 rows) against the same calls
  unpadded: outputs and cache entries bit for bit (with a fake capturer that reruns the call, or a real CUDA one).
- `model`: a 2-layer model's decoder body with the layers installed, called as the runner calls it, against
  transformers' body with the float weights.
- `invariance`: a tree pass, then each node of one root-to-leaf path decoded alone after its ancestors were
  committed (a fresh cache holding the same prefix): outputs and cache entries bit for bit; a prefill in one pass
  and in two chunks: bit for bit. The attention's chunk is shrunk to 16 keys so that the prefix lengths of the two
  ways cross chunk boundaries differently.
"""

from __future__ import annotations

import copy
import inspect
from typing import Optional

import numpy as np
import torch
from torch import nn

from helpers.tiny import tiny_config
from helpers.tiny_gguf import random_blocks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
         "up_proj": "Q8_0", "down_proj": "Q6_K"}  # a Q4_K_M-like mix (and a 32-block type in the gate/up group)
# a tree: parents of nodes 1.. (node 0 is the root); the path 0 -> 2 -> 5 -> 8 -> 11 -> 12 is checked alone
PARENTS = [-1, 0, 0, 1, 2, 2, 3, 4, 5, 5, 7, 8, 11, 6]
PATH = [0, 2, 5, 8, 11, 12]


class TinyLayer:
    """One random llama-family decoder layer (hidden 256, 4 heads of 64, 2 KV heads, MLP 512) in two forms: the
    transformers layer with float weights (the decoded blocks) and offspec's `Parts` over QLinear block rows."""

    def __init__(self, arch: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
        from offspec.formats.ggml import ggml_type
        from offspec.formats.gpu.layer import PROJECTIONS, Parts
        from offspec.formats.gpu.linear import decode
        from offspec.formats.modules import QLinear

        config = tiny_config(arch, hidden=256, heads=4, kv_heads=2, layers=1)
        config.intermediate_size = 512
        config._attn_implementation = "eager"
        cls = __import__("transformers").LlamaForCausalLM if arch == "llama" else \
            __import__("transformers").Qwen2ForCausalLM
        torch.manual_seed(seed)
        self.model = cls(config).eval()
        self.layer = self.model.model.layers[0].to(device=device, dtype=dtype)
        self.rotary = self.model.model.rotary_emb.to(device)
        rng = np.random.default_rng(seed)
        projections = []
        with torch.no_grad():
            for name in PROJECTIONS:
                linear = self.layer.get_submodule(name)
                short = name.rsplit(".", 1)[1]
                tid = ggml_type(TYPES[short]).id
                raw = torch.from_numpy(random_blocks(rng, TYPES[short], linear.out_features, linear.in_features))
                q = QLinear(tid, linear.in_features, linear.out_features, linear.bias is not None, device)
                q.qweight.copy_(raw)
                linear.weight.copy_(decode(raw.to(device), tid, linear.in_features, torch.float32))
                if linear.bias is not None:
                    linear.bias.normal_(0.0, 0.5)
                    q.bias.copy_(linear.bias.float())
                projections.append(q)
            for norm in (self.layer.input_layernorm, self.layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.1 * torch.randn(norm.weight.shape))
        attn = self.layer.self_attn
        self.parts = Parts(tuple(projections), (self.layer.input_layernorm, self.layer.post_attention_layernorm),
                           float(self.layer.input_layernorm.variance_epsilon), 4, 2, attn.head_dim,
                           float(attn.scaling), 0)
        self.dtype, self.device, self.hidden = dtype, device, 256

    def cache(self, capacity: int = 96):
        from offspec.spec.kvcache import SlotKVCache

        return SlotKVCache(1, capacity)

    def rope(self, positions: torch.Tensor):
        like = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(like, positions[None])
        return cos.to(self.dtype), sin.to(self.dtype)  # (1, q, D) each

    def ours(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor, cache,
             prefix: int) -> torch.Tensor:
        from offspec.formats.gpu.attention import TailKeys
        from offspec.formats.gpu.layer import decoder_layer

        cos, sin = self.rope(positions)
        cache.prepare(slots, visible.shape[1])
        k, v = cache.buffers(0, h, 2, self.parts.head_dim)
        return decoder_layer(h, self.parts, cos[0], sin[0], k[0], v[0], slots, TailKeys.of(visible, prefix))

    def theirs(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
               cache, layer: Optional[nn.Module] = None) -> torch.Tensor:
        """transformers' layer (or `layer`, another copy of it) in h's dtype."""
        layer = layer or self.layer
        cos, sin = self.rope(positions)
        cache.prepare(slots, visible.shape[1])
        mask = torch.zeros(visible.shape, dtype=h.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(h.dtype).min)
        name = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"
        with torch.no_grad():
            out = layer(h[None], attention_mask=mask[None, None], position_ids=positions[None],
                        position_embeddings=(cos.to(h.dtype), sin.to(h.dtype)), use_cache=True, **{name: cache})
        return (out[0] if isinstance(out, tuple) else out)[0]


def _causal(prefix: int, q: int, device) -> torch.Tensor:
    visible = torch.ones((q, prefix + q), dtype=torch.bool, device=device)  # (q, prefix + q)
    visible[:, prefix:] = torch.ones((q, q), dtype=torch.bool, device=device).tril()
    return visible


def _tree(prefix: int, device, n: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (n,), visible (n, prefix + n)) of the first n nodes of PARENTS (all: None) above `prefix` committed
    tokens."""
    n = n or len(PARENTS)
    anc = torch.zeros((n, n), dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(PARENTS[:n]):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    visible = torch.ones((n, prefix + n), dtype=torch.bool)
    visible[:, prefix:] = anc
    return torch.tensor(depth, device=device) + prefix, visible.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_hf(arch: str, dtype_name: str, device: Optional[torch.device] = None) -> dict:
    device = device or torch.device("cpu")
    tiny = TinyLayer(arch, DTYPES[dtype_name], device)
    wide = copy.deepcopy(tiny.layer).float() if tiny.dtype != torch.float32 else None  # transformers in float32
    gen = torch.Generator().manual_seed(1)
    prefix, n = 21, len(PARENTS)
    caches = {"ours": tiny.cache(), "theirs": tiny.cache(), "wide": tiny.cache()}
    h = torch.randn((prefix, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)  # (T, E)
    x = torch.randn((n, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)  # (n, E) tree nodes
    pos = torch.arange(prefix, device=device)
    positions, visible = _tree(prefix, device)
    slots = torch.arange(prefix, prefix + n, device=device)
    passes = (("prefill", h, pos, pos, _causal(0, prefix, device), 0), ("tree", x, positions, slots, visible, prefix))
    out = {}
    for name, inputs, p, s, vis, pre in passes:
        ours = tiny.ours(inputs, p, s, vis, caches["ours"], pre)
        theirs = tiny.theirs(inputs, p, s, vis, caches["theirs"])
        out[name] = _rel(ours, theirs)
        if wide is not None:
            reference = tiny.theirs(inputs.float(), p, s, vis, caches["wide"], wide)
            out[name + "_ours"], out[name + "_theirs"] = _rel(ours, reference), _rel(theirs, reference)
    for name in ("keys", "values"):
        got, ref = (getattr(caches[k], name)[0][:, :, : prefix + n] for k in ("ours", "theirs"))
        out[name] = _rel(got, ref)
    return out


def check_invariance(dtype_name: str, device: Optional[torch.device] = None, block_n: int = 16) -> dict:
    from offspec.formats.gpu import attention

    device = device or torch.device("cpu")
    attention.BLOCK_N = block_n
    tiny = TinyLayer("qwen2", DTYPES[dtype_name], device)
    gen = torch.Generator().manual_seed(2)
    prefix = 45  # the alone passes' prefixes 45 .. 50 cross the chunk boundary at 48
    h = torch.randn((prefix, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)
    pos = torch.arange(prefix, device=device)
    one, two = tiny.cache(), tiny.cache()
    whole = tiny.ours(h, pos, pos, _causal(0, prefix, device), one, 0)
    first = tiny.ours(h[:20], pos[:20], pos[:20], _causal(0, 20, device), two, 0)
    second = tiny.ours(h[20:], pos[20:], pos[20:], _causal(20, prefix - 20, device), two, 20)
    result = {"chunked_prefill": _same(whole, torch.cat([first, second])) and
              _same(one.keys[0][:, :, :prefix], two.keys[0][:, :, :prefix]) and
              _same(one.values[0][:, :, :prefix], two.values[0][:, :, :prefix])}
    positions, visible = _tree(prefix, device)
    n = len(PARENTS)
    x = torch.randn((n, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)  # the nodes' inputs
    tree = tiny.ours(x, positions, torch.arange(prefix, prefix + n, device=device), visible, one, prefix)
    alone, same_kv = [], []
    for i, node in enumerate(PATH):  # each decoded alone, its ancestors committed before it
        slot = torch.tensor([prefix + i], device=device)
        row = tiny.ours(x[node : node + 1], slot, slot, torch.ones((1, prefix + i + 1), dtype=torch.bool,
                                                                  device=device), two, prefix + i)
        alone.append(_same(row[0], tree[node]))
        same_kv.append(_same(two.keys[0][:, :, prefix + i], one.keys[0][:, :, prefix + node]) and
                       _same(two.values[0][:, :, prefix + i], one.values[0][:, :, prefix + node]))
    result.update(alone=alone, cache=same_kv, finite=bool(torch.isfinite(tree).all()))
    return result


class FakeCapturer:
    """graphs.Graphs' capturer without CUDA: a 'replay' runs the captured call again on its static inputs, into the
    same output buffer."""

    def capture(self, fn, static):
        from offspec.formats.gpu.graphs import Captured

        outputs = fn(*static)

        def replay():
            outputs.copy_(fn(*static))

        return Captured(replay, static, outputs)


def check_graphs(dtype_name: str, device: Optional[torch.device] = None, capturer=None) -> dict:
    from offspec.formats.gpu.attention import TailKeys
    from offspec.formats.gpu.graphs import Graphs, run_bucketed
    from offspec.formats.gpu.layer import decoder_layer

    device = device or torch.device("cpu")
    tiny = TinyLayer("qwen2", DTYPES[dtype_name], device)
    gen = torch.Generator().manual_seed(3)
    prefix = 20
    eager, graphed = tiny.cache(), tiny.cache()
    h = torch.randn((prefix, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)
    pos = torch.arange(prefix, device=device)
    for cache in (eager, graphed):
        tiny.ours(h, pos, pos, _causal(0, prefix, device), cache, 0)
    g = Graphs(capturer or FakeCapturer())
    rows, same_cache = [], []
    for n in (3, 5, 3):
        positions, visible = _tree(prefix, device, n)
        slots = torch.arange(prefix, prefix + n, device=device)
        x = torch.randn((n, tiny.hidden), generator=gen).to(device=device, dtype=tiny.dtype)
        want = tiny.ours(x, positions, slots, visible, eager, prefix)
        cos, sin = tiny.rope(positions)
        graphed.prepare(slots, visible.shape[1])
        k, v = graphed.buffers(0, x, 2, tiny.parts.head_dim)

        def layer(h, cos, sin, slots, prefix_t, gather, count):
            return decoder_layer(h, tiny.parts, cos, sin, k[0], v[0], slots, TailKeys(prefix_t, gather, count))

        got = run_bucketed(g, "layer", layer, x, cos[0], sin[0], slots, TailKeys.of(visible, prefix))
        rows.append(_same(got, want))
        same_cache.append(_same(graphed.keys[0][:, :, : prefix + n], eager.keys[0][:, :, : prefix + n]) and
                          _same(graphed.values[0][:, :, : prefix + n], eager.values[0][:, :, : prefix + n]))
    return {"rows": rows, "cache": same_cache, "captures": g.captures, "replays": g.replays}


def check_model(arch: str, device: Optional[torch.device] = None) -> dict:
    """A tiny 2-layer model's decoder body with offspec's CUDA layers installed (forced on the CPU: the install's
    device check patched) against the same body with float weights and transformers' eager layers, called as the
    runner calls it: a prefill pass, then a tree pass; relative error of the final hidden states (float32)."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import support
    from offspec.formats.gpu import layer as gpu_layer
    from offspec.formats.gpu.attention import TailKeys
    from offspec.formats.gpu.linear import decode
    from offspec.formats.modules import replace_linear
    from offspec.spec.kvcache import SlotKVCache

    device = device or torch.device("cpu")
    config = tiny_config(arch, hidden=256, heads=4, kv_heads=2, layers=2)
    config.intermediate_size = 512
    config._attn_implementation = "eager"
    cls = __import__("transformers").LlamaForCausalLM if arch == "llama" else \
        __import__("transformers").Qwen2ForCausalLM
    torch.manual_seed(0)
    reference = cls(config).eval().to(device)
    ours = copy.deepcopy(reference)
    rng = np.random.default_rng(5)
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            for name in gpu_layer.PROJECTIONS:
                linear = layer.get_submodule(name)
                type_name = TYPES[name.rsplit(".", 1)[1]]
                tid = ggml_type(type_name).id
                raw = torch.from_numpy(random_blocks(rng, type_name, linear.out_features, linear.in_features))
                linear.weight.copy_(decode(raw.to(device), tid, linear.in_features, torch.float32))
                q = replace_linear(ours.model.layers[i], name, tid, device)
                q.qweight.copy_(raw)
                if linear.bias is not None:
                    linear.bias.normal_(0.0, 0.5)
                    q.bias.copy_(linear.bias)
    forced = gpu_layer.cuda_layers
    gpu_layer.cuda_layers = lambda model, dev, dtype: support.unsupported(model)  # the CPU stands in for CUDA
    try:
        reason = gpu_layer.install(ours, device, torch.float32)
    finally:
        gpu_layer.cuda_layers = forced
    assert reason is None, reason
    caches = {"ours": SlotKVCache(2, 96), "theirs": SlotKVCache(2, 96)}
    name = "cache" if "cache" in inspect.signature(reference.model.forward).parameters else "past_key_values"
    prefix, n = 21, len(PARENTS)
    positions, visible = _tree(prefix, device)
    passes = ((torch.arange(prefix, device=device), torch.arange(prefix, device=device), _causal(0, prefix, device), 0),
              (positions, torch.arange(prefix, prefix + n, device=device), visible, prefix))
    out = {}
    gen = torch.Generator().manual_seed(6)
    for label, (pos, slots, vis, pre) in zip(("prefill", "tree"), passes):
        ids = torch.randint(0, config.vocab_size, (len(pos),), generator=gen).to(device)
        results = {}
        for key, model in (("ours", ours), ("theirs", reference)):
            caches[key].prepare(slots, vis.shape[1])
            if key == "ours":  # the runner's CUDA branch: the bool pattern passed through, TailKeys to the layers
                with torch.no_grad(), gpu_layer.active(TailKeys.of(vis, pre)):
                    h = model.model(input_ids=ids[None], position_ids=pos[None], attention_mask=vis[None, None],
                                    use_cache=True, **{name: caches[key]}).last_hidden_state[0]
            else:
                mask = torch.zeros(vis.shape, device=device).masked_fill_(~vis, torch.finfo(torch.float32).min)
                with torch.no_grad():
                    h = model.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask[None, None],
                                    use_cache=True, **{name: caches[key]}).last_hidden_state[0]
            results[key] = h
        out[label] = _rel(results["ours"], results["theirs"])
    out["keys"] = _rel(caches["ours"].keys[1][:, :, : prefix + n], caches["theirs"].keys[1][:, :, : prefix + n])
    out["installed"] = all(hasattr(layer, "_offspec_gpu_parts") for layer in ours.model.layers)
    return out


def run(check: str, args: list[str]):
    if check == "hf":
        return check_hf(args[0], args[1])
    if check == "invariance":
        return check_invariance(args[0])
    if check == "graphs":
        return check_graphs(args[0])
    if check == "model":
        return check_model(args[0])
    raise SystemExit(f"unknown check {check!r}")
