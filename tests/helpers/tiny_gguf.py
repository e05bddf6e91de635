"""Tiny random GGUF models of every family offspec runs, written with the gguf package, for the low-bit tests.

`save_tiny_gguf(path, arch, types=...)` writes a GGUF whose linear weights are random normal(0, 0.2) values (as in
tests/helpers/tiny.py) encoded as ggml blocks of the given types, norms and biases F32, the byte tokenizer of
tests/helpers/tiny.py as a "gpt2" tokenizer, and a chat template. `arch` is a family (`FAMILIES`), laid out as
llama.cpp writes it: llama (and mistral: a llama file named Mistral, as llama.cpp converts Mistral; transformers
reads it as llama too);
qwen2 (q/k/v biases); qwen3 (per-head q/k norms); gemma2 (sandwich norms, soft-capping, local and global layers, the
LM head tied to the token table); gemma3 (q/k norms, local layers with their own rope base); phi3 (fused q|k|v and
gate|up tensors, a partial rotary embedding). transformers reads it like any GGUF, and
`gguf.dequantize` gives the float weights it stands for. `noise` perturbs the weights of the model `seed` gives:
a draft that mostly agrees with it. `random_blocks` makes arbitrary valid blocks of any type (kernel tests; the
lattice IQ types, which have no encoder here, are written as random blocks); `save_shape_twin` writes a GGUF with a big
model's shapes, a tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from .tiny import CHAT_TEMPLATE, MERGES, SPECIALS, make_tokenizer

# where the float16 scale fields sit in each block type (IQ1_M: spread over the top nibbles of its scale words,
# see _iq1_m_scale; MXFP4: none, its scale is the E8M0 exponent byte 0, see random_blocks), and the scale to put
# there (weights of roughly 0.01 - 0.2)
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
               "IQ1_M": (), "TQ1_0": (52,), "TQ2_0": (64,), "MXFP4": ()}
SCALE = {"Q4_0": 0.02, "Q4_1": 0.02, "Q5_0": 0.01, "Q5_1": 0.01, "Q8_0": 0.002, "Q2_K": 0.004, "Q3_K": 0.004,
         "Q4_K": 0.0006, "Q5_K": 0.0003, "Q6_K": 0.0002, "IQ4_NL": 0.002, "IQ4_XS": 0.0001, "IQ2_XXS": 0.001,
         "IQ2_XS": 0.001, "IQ2_S": 0.001, "IQ3_XXS": 0.0005, "IQ3_S": 0.0005, "IQ1_S": 0.01, "IQ1_M": 0.01,
         "TQ1_0": 0.05, "TQ2_0": 0.05, "MXFP4": 2.0**-7}
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _halves(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _encode_k45(w: np.ndarray, five: bool) -> np.ndarray:
    """Q4_K / Q5_K blocks of float rows (a simple min/max encoder: valid, not llama.cpp's optimal search)."""
    rows, cols = w.shape
    top = 31 if five else 15
    sub = w.reshape(rows, cols // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # (rows, nb, 8): the minimums are subtracted, so keep them <= 0
    scale = np.maximum((sub.max(-1) - lo) / top, 1e-8)
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)  # (rows, nb)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.maximum(d[..., None], 1e-12)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / np.maximum(dmin[..., None], 1e-12)), 0, 63).astype(np.uint8)
    q = np.clip(np.rint((sub + (dmin[..., None] * mn)[..., None]) / (d[..., None] * sc)[..., None]), 0, top)
    q = q.astype(np.uint8)  # (rows, nb, 8, 32)
    packed = np.zeros((rows, cols // 256, 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    qs = (q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)  # (rows, nb, 4, 32): subs 2c, 2c+1
    parts = [_halves(d), _halves(dmin), packed]
    if five:
        qh = np.zeros((rows, cols // 256, 32), np.uint8)
        for j in range(8):
            qh |= ((q[..., j, :] >> 4) & 1) << j
        parts.append(qh)
    parts.append(qs.reshape(rows, cols // 256, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _encode_q6_k(w: np.ndarray) -> np.ndarray:
    rows, cols = w.shape
    sub = w.reshape(rows, cols // 256, 16, 16)
    scale = np.maximum(np.abs(sub).max(-1) / 31, 1e-8)  # (rows, nb, 16)
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.maximum(d[..., None], 1e-12)), 1, 127).astype(np.int8)
    q = np.clip(np.rint(sub / (d[..., None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    ql = np.zeros((rows, cols // 256, 2, 64), np.uint8)
    qh = np.zeros((rows, cols // 256, 2, 32), np.uint8)
    for s in range(4):  # element h*128 + s*32 + l
        half = (s % 2) * 32
        ql[..., half : half + 32] |= (q[:, :, :, s, :] & 0x0F) << (4 * (s // 2))
        qh |= ((q[:, :, :, s, :] >> 4) & 3) << (2 * s)
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8), _halves(d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _nearest_iq4(v: np.ndarray) -> np.ndarray:
    """values in units of the block scale -> the index of the nearest entry of IQ4_NL's table (uint8)."""
    return np.abs(v[..., None] - KVALUES_IQ4NL).argmin(-1).astype(np.uint8)


def _pack_iq4(q: np.ndarray) -> np.ndarray:
    """(..., 32) indices -> (..., 16) bytes: elements 0-15 in the low nibbles, 16-31 in the high ones."""
    return q[..., :16] | (q[..., 16:] << 4)


def _encode_iq4_nl(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of float rows (the nearest table entry at scale max|x| / 127: valid, not llama.cpp's search)."""
    rows, cols = w.shape
    blk = w.reshape(rows, cols // 32, 32)
    d = (np.abs(blk).max(-1) / 127).astype(np.float16)  # (rows, nb)
    q = _nearest_iq4(blk / np.maximum(d.astype(np.float32), 1e-12)[..., None])
    return np.concatenate([_halves(d), _pack_iq4(q)], axis=-1).reshape(rows, -1)


def _encode_iq4_xs(w: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks of float rows: a scale per 32 as a multiple (0..31) of the super-block's d."""
    rows, cols = w.shape
    sub = w.reshape(rows, cols // 256, 8, 32)
    scale = np.abs(sub).max(-1) / 127  # (rows, nb, 8)
    d = (scale.max(-1) / 31).astype(np.float16)  # (rows, nb)
    df = np.maximum(d.astype(np.float32), 1e-12)[..., None]
    ls = np.clip(np.rint(scale / df), 1, 31).astype(np.int64)  # (rows, nb, 8): values ls, stored ls + 32
    q = _nearest_iq4(sub / (df * ls)[..., None])  # (rows, nb, 8, 32)
    stored = ls + 32
    low = (stored & 0x0F).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # (rows, nb, 4)
    scales_h = sum(((stored[..., j] >> 4) & 3) << (2 * j) for j in range(8)).astype(np.uint16)  # (rows, nb)
    parts = [_halves(d), scales_h.view(np.uint8).reshape(rows, -1, 2), scales_l, _pack_iq4(q).reshape(rows, -1, 128)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def mxfp4_exponents(rng: np.random.Generator, shape: tuple[int, ...], scale: float = SCALE["MXFP4"]) -> np.ndarray:
    """Random MXFP4 exponents (uint8) around `scale`: 2**(e - 128) within a factor 2 of it (one of 3 powers of 2)."""
    centre = 128 + int(round(np.log2(scale)))
    return rng.integers(centre - 1, centre + 2, shape).astype(np.uint8)


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """(rows, cols) float32 -> (rows, row_bytes) uint8 blocks of `type_name` (gguf's quantizers, or the simple
    k-quant and IQ4 encoders above). MXFP4 is gguf's quantizer, llama.cpp's arithmetic (quantize_row_mxfp4_ref:
    e = floor(log2 max|x|) - 2 + 127, then the nearest table entry): valid blocks within 4 * 2**(e - 128) of x (half
    the table's widest step, 8 to 12, and what a block's top clips above 12), about 12% of normal weights' spread."""
    import gguf

    if type_name == "IQ4_NL":
        return _encode_iq4_nl(values)
    if type_name == "IQ4_XS":
        return _encode_iq4_xs(values)
    if type_name in ("Q4_K", "Q5_K"):
        return _encode_k45(values, type_name == "Q5_K")
    if type_name == "Q6_K":
        return _encode_q6_k(values)
    qt = gguf.GGMLQuantizationType[type_name]
    return np.ascontiguousarray(gguf.quantize(values.astype(np.float32), qt)).view(np.uint8).reshape(values.shape[0], -1)


RANDOM_ONLY = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")  # lattice types: no encoder
REFUSED = ("NVFP4",)  # a type offspec refuses (and gguf cannot quantize): random bytes, never decoded


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks of `type_name` with small positive scales (valid, finite)."""
    import gguf

    qt = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    if type_name in ("F32", "F16", "BF16"):
        values = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        return np.ascontiguousarray(gguf.quantize(values, qt)).view(np.uint8).reshape(rows, -1)
    nb = cols // block
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)  # any bytes are valid indices, signs, scales
    for i, off in enumerate(HALF_FIELDS[type_name] if type_name not in REFUSED else ()):
        scale = SCALE[type_name] * (1.0 if i == 0 else 0.5)
        halves = (rng.uniform(0.5, 1.5, (rows, nb)) * scale).astype(np.float16)
        raw[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, nb, 2)
    if type_name == "MXFP4":  # the E8M0 exponent: any byte is a power of 2 (255: 2**127, overflowing the table's 12)
        raw[:, :, 0] = mxfp4_exponents(rng, (rows, nb))
    if type_name == "IQ1_M":  # d's 16 bits in the top nibbles of the 4 scale words (bytes 48-55)
        bits = (rng.uniform(0.5, 1.5, (rows, nb)) * SCALE[type_name]).astype(np.float16).view(np.uint16)
        for i in range(4):
            top = ((bits >> (4 * i)) & 0x0F).astype(np.uint8) << 4
            raw[:, :, 49 + 2 * i] = (raw[:, :, 49 + 2 * i] & 0x0F) | top
    return raw.reshape(rows, -1)


def _add_tokenizer(w, vocab: dict) -> None:
    """The file type and the byte-level tokenizer (`vocab`: token -> id, the specials included) with its chat
    template, on the GGUFWriter `w`."""
    import gguf

    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(pair) for pair in MERGES])  # as every BPE GGUF has them (helpers/tiny.py)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_pad_token_id(vocab["<pad>"])
    w.add_chat_template(CHAT_TEMPLATE)


def _writer(path: Path, arch: str, name: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
            vocab: dict):
    """A GGUFWriter with the model's metadata and the byte tokenizer of `vocab` (token -> id)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    _add_tokenizer(w, vocab)
    return w


def save_shape_twin(path: Path, layers: int = 2, hidden: int = 8192, inter: int = 28672, heads: int = 64,
                    kv_heads: int = 8, type_name: str = "IQ4_XS", output: str = "Q6_K", seed: int = 0) -> Path:
    """A llama GGUF with a big model's shapes (default: Llama-3-70B's) and `layers` layers of random valid blocks of
    `type_name` (the LM head `output`), the tiny byte vocabulary. Written a tensor at a time: no float weights are
    made, and the largest array in memory is one tensor's blocks (125 MB for a 70B's FFN in IQ4_XS)."""
    import gguf

    from .tiny import BASE_VOCAB

    rng = np.random.default_rng(seed)
    vocab = make_tokenizer(BASE_VOCAB).get_vocab()
    kv = kv_heads * (hidden // heads)
    tensors = [("token_embd.weight", len(vocab), hidden, type_name)]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", 0, hidden, "F32"), (p + "ffn_norm.weight", 0, hidden, "F32"),
                    (p + "attn_q.weight", hidden, hidden, type_name), (p + "attn_k.weight", kv, hidden, type_name),
                    (p + "attn_v.weight", kv, hidden, type_name), (p + "attn_output.weight", hidden, hidden, type_name),
                    (p + "ffn_gate.weight", inter, hidden, type_name), (p + "ffn_up.weight", inter, hidden, type_name),
                    (p + "ffn_down.weight", hidden, inter, type_name)]
    tensors += [("output_norm.weight", 0, hidden, "F32"), ("output.weight", len(vocab), hidden, output)]
    w = _writer(path, "llama", "shape-twin", hidden, layers, heads, kv_heads, inter, vocab)
    for name, rows, cols, t in tensors:
        qt = gguf.GGMLQuantizationType[t]
        if rows == 0:  # a norm: F32 (cols,)
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), 4 * cols)
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            w.add_tensor_info(name, (rows, cols // block * nbytes), np.dtype(np.uint8), rows * cols // block * nbytes,
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, rows, cols, t in tensors:
        if rows == 0:
            w.write_tensor_data((1.0 + 0.05 * rng.standard_normal(cols)).astype(np.float32))
        else:
            w.write_tensor_data(random_blocks(rng, t, rows, cols))
    w.close()
    return Path(path)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# mixtures of experts: a router and stacked experts in place of each layer's dense FFN (qwen2moe: a shared expert
# with its own sigmoid gate beside them)
MOE_FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "gpt-oss")
# llama.cpp writes Mistral and Mixtral as llama (transformers tells Mistral apart by the name; Mixtral by its experts)
GGUF_ARCH = {"mistral": "llama", "mixtral": "llama"}


def save_tiny_gguf(path: Path, arch: str = "qwen2", seed: int = 0, hidden: int = 256, layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, inter: int = 512, types: dict | None = None,
                   noise: float = 0.0, tied: bool = False, logit_scale: float = 3.0, vocab_extra: int = 0,
                   head_dim: int | None = None, window: int = 8, rotary: int | None = None,
                   softcap: tuple[float, float] = (50.0, 30.0), rope_freqs: np.ndarray | None = None,
                   experts: int = 0, expert_metadata: bool = True, extra: dict | None = None,
                   expert_used: int = 2, expert_inter: int = 256) -> Path:
    """Write a tiny `arch` GGUF to `path` (a .gguf file). `types` maps "linear", "down", "v", "embed", "output"
    to ggml type names (defaults: a Q4_K_M-like mix); `logit_scale` multiplies the LM head's block scales (> 1:
    sharper next-token distributions, so a noisy draft agrees with the target more often); `vocab_extra` adds
    tokens (another tokenizer). `head_dim` (default hidden / heads): written where the family reads it (qwen3,
    gemma); `window`: the sliding window of gemma's local layers (small, so short prompts reach past it);
    `rotary`: phi3's rotary dims per head (default: half the head, a partial rotary); `softcap`: gemma2's
    attention and final logit soft-capping; `rope_freqs`: llama 3.1's rope frequency factors, as a tensor (phi3: its
    longrope factors, as both the long and the short set). `experts` (llama): stacked F32 experts in a plain llama
    file (`ffn_*_exps`), the `llama.expert_count` metadata unless `expert_metadata` is False; `extra`: more F32
    tensors, by name. The MoE families (`MOE_FAMILIES`; `experts` defaults to 8) hold, per layer, an F32 router
    (`ffn_gate_inp`) and stacked experts of `expert_inter` rows (`ffn_{gate,up,down}_exps`, ggml's (cols, rows,
    experts): `types["experts"]` for gate and up, `types["down_exps"]` for down), `expert_used` chosen per token;
    qwen2moe also a shared expert (`ffn_*_shexp`, `inter` rows) and its F32 gate (`ffn_gate_inp_shexp`); gpt-oss
    F32 biases on q, k, v, o, the router and each expert's projections, attention sinks, every other layer local
    (`window`, the first one included) and a YaRN rope (factor 32 over an original context of 64)."""
    import gguf

    if arch not in FAMILIES + MOE_FAMILIES:
        raise ValueError(f"unknown tiny family {arch!r}; one of {FAMILIES + MOE_FAMILIES}")
    types = {"linear": "Q4_K", "down": "Q6_K", "v": "Q6_K", "embed": "Q4_K", "output": "Q6_K", "experts": "Q4_K",
             "down_exps": "Q6_K", **(types or {})}
    moe = arch in MOE_FAMILIES
    experts = experts or (8 if moe else 0)
    from .tiny import BASE_VOCAB

    gemma = arch.startswith("gemma")
    tied = tied or arch == "gemma2"  # llama.cpp's gemma2 has no output tensor
    head_dim = head_dim or hidden // heads
    tok = make_tokenizer(BASE_VOCAB + vocab_extra)
    vocab = tok.get_vocab()
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(10_000 + seed)

    def blocks(name: str, rows: int, cols: int, type_name: str, scale: float = 1.0) -> np.ndarray:
        if type_name in RANDOM_ONLY + REFUSED:  # no encoder here: random valid blocks (REFUSED: random bytes)
            return random_blocks(rng, type_name, rows, cols)
        values = rng.normal(0.0, 0.2, (rows, cols)).astype(np.float32) * scale  # like tests/helpers/tiny.py's models
        if noise > 0:
            values = values + noise * noise_rng.standard_normal(values.shape).astype(np.float32)
        return encode(values, type_name)

    w = gguf.GGUFWriter(str(path), GGUF_ARCH.get(arch, arch))
    names = {"mistral": f"Mistral-tiny-{seed}", "mixtral": f"Mixtral-tiny-{seed}"}
    w.add_name(names.get(arch, f"tiny-{arch}-{seed}"))  # as Mistral's files are named
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10000.0)
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma or arch == "gpt-oss":
        w.add_sliding_window(window)
    if arch == "gpt-oss":  # YaRN as gpt-oss's (factor 32), over a short original context so the ramp matters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    if arch == "gemma3":  # every other layer global (the real ones: every 6th), so two layers hold both kinds
        w.add_sliding_window_pattern(2)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(softcap[0])
        w.add_final_logit_softcapping(softcap[1])
    if arch == "phi3":
        w.add_rope_dimension_count(rotary or head_dim // 2)
    if experts and expert_metadata:
        w.add_expert_count(experts)
        w.add_expert_used_count(expert_used)
    if moe and arch != "mixtral":  # llama.cpp's mixtral reads its experts' rows from the tensors
        w.add_expert_feed_forward_length(expert_inter)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(inter)
    _add_tokenizer(w, vocab)

    def add(name: str, raw: np.ndarray, type_name: str, cols: int) -> None:
        qt = gguf.GGMLQuantizationType[type_name]
        w.add_tensor(name, raw, raw_dtype=qt)  # (rows, row_bytes) uint8: the shape follows from the type

    def floats(name: str, n: int, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + 0.05 * rng.standard_normal(n)).astype(np.float32))

    v = len(vocab)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    add("token_embd.weight", blocks("embed", v, hidden, types["embed"]), types["embed"], hidden)
    for i in range(layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", hidden)  # gemma's norms are stored as 1 + w, as llama.cpp writes them
        floats(p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight"), hidden)
        if gemma:
            floats(p + "post_attention_norm.weight", hidden)
            floats(p + "post_ffw_norm.weight", hidden)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            floats(p + "attn_q_norm.weight", head_dim)
            floats(p + "attn_k_norm.weight", head_dim)
        if arch == "phi3":  # q|k|v and gate|up, fused
            rows = q_rows + 2 * kv_rows
            add(p + "attn_qkv.weight", blocks("attn_qkv", rows, hidden, types["linear"]), types["linear"], hidden)
        else:
            for n, rows, t in (("attn_q", q_rows, "linear"), ("attn_k", kv_rows, "linear"), ("attn_v", kv_rows, "v")):
                add(p + n + ".weight", blocks(n, rows, hidden, types[t]), types[t], hidden)
                if arch in ("qwen2", "qwen2moe", "gpt-oss"):
                    floats(p + n + ".bias", rows, mean=0.0)
        add(p + "attn_output.weight", blocks("attn_output", hidden, q_rows, types["linear"]), types["linear"], q_rows)
        if arch == "gpt-oss":
            floats(p + "attn_output.bias", hidden, mean=0.0)
            w.add_tensor(p + "attn_sinks.weight", rng.normal(0.0, 1.0, heads).astype(np.float32))
        if moe:  # ggml's (cols, rows, experts): (experts, rows, row_bytes) blocks
            w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.5, (experts, hidden)).astype(np.float32))
            if arch == "gpt-oss":
                w.add_tensor(p + "ffn_gate_inp.bias", rng.normal(0, 0.5, experts).astype(np.float32))
            for n, rows, cols, t in (("ffn_gate_exps", expert_inter, hidden, "experts"),
                                     ("ffn_up_exps", expert_inter, hidden, "experts"),
                                     ("ffn_down_exps", hidden, expert_inter, "down_exps")):
                stacked = np.stack([blocks(n, rows, cols, types[t]) for _ in range(experts)])
                add(p + n + ".weight", stacked, types[t], cols)
                if arch == "gpt-oss":  # ggml's (rows, experts)
                    w.add_tensor(p + n + ".bias", rng.normal(0, 0.1, (experts, rows)).astype(np.float32))
            if arch == "qwen2moe":
                floats(p + "ffn_gate_inp_shexp.weight", hidden, mean=0.0)
                for n in ("ffn_gate_shexp", "ffn_up_shexp"):
                    add(p + n + ".weight", blocks(n, inter, hidden, types["linear"]), types["linear"], hidden)
                add(p + "ffn_down_shexp.weight", blocks("down", hidden, inter, types["down"]), types["down"], inter)
            continue
        if experts:  # (experts, rows, cols) each, ggml's (cols, rows, experts)
            w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.2, (experts, hidden)).astype(np.float32))
            for n, rows, cols in (("ffn_gate_exps", inter, hidden), ("ffn_up_exps", inter, hidden),
                                  ("ffn_down_exps", hidden, inter)):
                w.add_tensor(p + n + ".weight", rng.normal(0, 0.2, (experts, rows, cols)).astype(np.float32))
            continue
        if arch == "phi3":
            add(p + "ffn_up.weight", blocks("ffn_up", 2 * inter, hidden, types["linear"]), types["linear"], hidden)
        else:
            for n in ("ffn_gate", "ffn_up"):
                add(p + n + ".weight", blocks(n, inter, hidden, types["linear"]), types["linear"], hidden)
        add(p + "ffn_down.weight", blocks("down", hidden, inter, types["down"]), types["down"], inter)
    floats("output_norm.weight", hidden)
    if rope_freqs is not None:
        name = "rope_freqs.weight" if arch != "phi3" else None  # phi3's longrope: a long and a short set
        for n in ([name] if name else ["rope_factors_long.weight", "rope_factors_short.weight"]):
            w.add_tensor(n, np.asarray(rope_freqs, dtype=np.float32))
    if not tied:
        add("output.weight", blocks("output", v, hidden, types["output"], logit_scale), types["output"], hidden)
    for name, values in (extra or {}).items():
        w.add_tensor(name, np.asarray(values, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def mapped_file(t) -> str:
    """The file whose memory mapping holds tensor `t`'s first byte ("" where it is anonymous memory; Linux)."""
    addr = t.data_ptr()
    for line in open("/proc/self/maps", encoding="utf-8"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5] if len(parts) > 5 else ""
    return ""
