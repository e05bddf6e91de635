"""Write a shape twin of Qwen3-30B-A3B Q4_K_M, or of gpt-oss-20b as ggml-org's MXFP4 file holds it: the real file's
metadata, tensor names, shapes and ggml types, random blocks with sane scales, and the Qwen tokenizer (copied from a
Qwen2.5 GGUF: Qwen3 keeps its vocabulary).

    python scripts/moe_twin.py OUT.gguf [--family qwen3moe|gpt-oss] [--layers N] [--experts N] [--tokenizer Q.gguf]

qwen3moe: 18.6 GB with every layer, as the real file is, written a tensor at a time (the largest array in memory is
one stacked expert tensor's blocks, 226 MB). Types follow llama.cpp's Q4_K_M rule: Q4_K everywhere, Q6_K for the LM
head and for attn_v and ffn_down_exps in the layers `use_more_bits` picks (the first and last eighth, every third
between); norms and routers F32.

gpt-oss: 24 layers of 32 experts (4 routed), the experts MXFP4, attention, token table and LM head Q8_0, norms,
biases, sinks and routers F32, a 128-token window on every other layer and YaRN (factor 32). Its vocabulary is the
Qwen tokenizer's 151,936 tokens, not o200k's 201,088 (no o200k GGUF here): 11.8 GB against the real file's 12.1 GB,
the difference all in the token table and LM head.

A twin times what offspec and llama.cpp do with such a file; its routing is not a real model's (random weights:
report the expert-use distribution beside every figure, as `offspec bench` prints it for a mixture). Written to a
temp name and renamed: Ctrl-C leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_INTER, DENSE_INTER = 2048, 32, 4, 128, 768, 6144
VOCAB, TOP_K, CONTEXT, ROPE_BASE, EPS = 151936, 8, 40960, 1_000_000.0, 1e-6
# gpt-oss-20b's shape (its config.json), but the vocabulary (module doc)
OSS = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, inter=2880, top_k=4, context=131072, window=128,
           rope_base=150000.0, eps=1e-5, experts=32, layers=24)
# block layouts: (values per block, bytes per block, offsets of the fp16 scale fields, their scale); MXFP4's scale is
# one E8M0 byte at 0 (2^(e - 128) per unit of its table: 119-121 gives values up to 0.02-0.09)
BLOCKS = {"Q4_K": (256, 144, (0, 2), 0.0006), "Q6_K": (256, 210, (208,), 0.0002), "Q8_0": (32, 34, (0,), 0.0002),
          "MXFP4": (32, 17, (), 0.0)}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape (cols, rows[, experts]), type) of every tensor, in the file's order."""
    out = [("token_embd.weight", (HIDDEN, VOCAB), "Q4_K")]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(layers):
        p, more = f"blk.{i}.", use_more_bits(i, layers)
        out += [(p + "attn_norm.weight", (HIDDEN,), "F32"), (p + "attn_q.weight", (HIDDEN, q), "Q4_K"),
                (p + "attn_k.weight", (HIDDEN, kv), "Q4_K"), (p + "attn_v.weight", (HIDDEN, kv), "Q6_K" if more else "Q4_K"),
                (p + "attn_output.weight", (q, HIDDEN), "Q4_K"), (p + "attn_q_norm.weight", (HEAD_DIM,), "F32"),
                (p + "attn_k_norm.weight", (HEAD_DIM,), "F32"), (p + "ffn_norm.weight", (HIDDEN,), "F32"),
                (p + "ffn_gate_inp.weight", (HIDDEN, experts), "F32"),
                (p + "ffn_gate_exps.weight", (HIDDEN, EXPERT_INTER, experts), "Q4_K"),
                (p + "ffn_up_exps.weight", (HIDDEN, EXPERT_INTER, experts), "Q4_K"),
                (p + "ffn_down_exps.weight", (EXPERT_INTER, HIDDEN, experts), "Q6_K" if more else "Q4_K")]
    return out + [("output_norm.weight", (HIDDEN,), "F32"), ("output.weight", (HIDDEN, VOCAB), "Q6_K")]


def gpt_oss_tensors(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's tensors as ggml-org's MXFP4 file has them (ggml shapes (cols, rows[, experts]))."""
    h, inter = OSS["hidden"], OSS["inter"]
    q, kv = OSS["heads"] * OSS["head_dim"], OSS["kv_heads"] * OSS["head_dim"]
    out = [("token_embd.weight", (h, VOCAB), "Q8_0")]
    e = experts
    layer = [("attn_norm.weight", (h,), "F32"), ("attn_q.weight", (h, q), "Q8_0"), ("attn_q.bias", (q,), "F32"),
             ("attn_k.weight", (h, kv), "Q8_0"), ("attn_k.bias", (kv,), "F32"), ("attn_v.weight", (h, kv), "Q8_0"),
             ("attn_v.bias", (kv,), "F32"), ("attn_output.weight", (q, h), "Q8_0"), ("attn_output.bias", (h,), "F32"),
             ("attn_sinks.weight", (OSS["heads"],), "F32"), ("post_attention_norm.weight", (h,), "F32"),
             ("ffn_gate_inp.weight", (h, e), "F32"), ("ffn_gate_inp.bias", (e,), "F32"),
             ("ffn_gate_exps.weight", (h, inter, e), "MXFP4"), ("ffn_gate_exps.bias", (inter, e), "F32"),
             ("ffn_up_exps.weight", (h, inter, e), "MXFP4"), ("ffn_up_exps.bias", (inter, e), "F32"),
             ("ffn_down_exps.weight", (inter, h, e), "MXFP4"), ("ffn_down_exps.bias", (h, e), "F32")]
    for i in range(layers):
        out += [(f"blk.{i}.{name}", shape, t) for name, shape, t in layer]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (h, VOCAB), "Q8_0")]


def blocks(rng: np.random.Generator, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random valid blocks: (..., rows, row_bytes) uint8, the fp16 scales (MXFP4: its exponent) set to sane values."""
    per, nbytes, halves, scale = BLOCKS[type_name]
    cols, lead = shape[0], tuple(reversed(shape[1:]))
    raw = rng.integers(0, 256, (*lead, cols // per, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":
        raw[..., 0] = rng.integers(119, 122, raw.shape[:-1], dtype=np.uint8)
    for i, off in enumerate(halves):
        values = (rng.uniform(0.5, 1.5, raw.shape[:-1]) * scale * (1.0 if i == 0 else 0.5)).astype(np.float16)
        raw[..., off : off + 2] = values.view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead, -1)


def floats(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if "ffn_gate_inp.weight" in name:  # a router: (experts, hidden)
        return rng.normal(0.0, 0.05, tuple(reversed(shape))).astype(np.float32)
    if name.endswith(".bias") or "sinks" in name:  # biases and attention sinks
        return rng.normal(0.0, 0.02, tuple(reversed(shape))).astype(np.float32)
    return (1.0 + 0.05 * rng.standard_normal(shape[0])).astype(np.float32)  # a norm


def copy_tokenizer(writer, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)


def _qwen3_metadata(w, layers: int, experts: int) -> None:
    import gguf

    w.add_name("Qwen3-30B-A3B shape twin (random blocks)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_block_count(layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(DENSE_INTER)
    w.add_expert_feed_forward_length(EXPERT_INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(EPS)
    w.add_expert_count(experts)
    w.add_expert_used_count(min(TOP_K, experts))


def _gpt_oss_metadata(w, layers: int, experts: int) -> None:
    import gguf

    w.add_name("gpt-oss-20b shape twin (random blocks)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_block_count(layers)
    w.add_context_length(OSS["context"])
    w.add_embedding_length(OSS["hidden"])
    w.add_feed_forward_length(OSS["inter"])
    w.add_expert_feed_forward_length(OSS["inter"])
    w.add_head_count(OSS["heads"])
    w.add_head_count_kv(OSS["kv_heads"])
    w.add_key_length(OSS["head_dim"])
    w.add_value_length(OSS["head_dim"])
    w.add_rope_freq_base(OSS["rope_base"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_layer_norm_rms_eps(OSS["eps"])
    w.add_sliding_window(OSS["window"])
    w.add_expert_count(experts)
    w.add_expert_used_count(min(OSS["top_k"], experts))


FAMILIES = {"qwen3moe": (_qwen3_metadata, tensors, 48, 128), "gpt-oss": (_gpt_oss_metadata, gpt_oss_tensors, 24, 32)}


def write_twin(out: Path, layers: int, experts: int, tokenizer: Path, seed: int, family: str = "qwen3moe") -> None:
    import gguf

    metadata, plan_of, _, _ = FAMILIES[family]
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), family)
        metadata(w, layers, experts)
        copy_tokenizer(w, tokenizer)
        plan = plan_of(layers, experts)
        for name, shape, t in plan:
            if t == "F32":
                n = int(np.prod(shape))
                w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), 4 * n)
            else:
                qt = gguf.GGMLQuantizationType[t]
                per, block_bytes = BLOCKS[t][:2]
                nbytes = int(np.prod(shape[1:])) * shape[0] // per * block_bytes
                byte_shape = (*reversed(shape[1:]), shape[0] // per * block_bytes)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, t) in enumerate(plan):
            w.write_tensor_data(floats(rng, name, shape) if t == "F32" else blocks(rng, t, shape))
            if name.endswith("ffn_down_exps.weight"):
                print(f"\rwriting {out.name}: layer {name.split('.')[1]} of {layers}", end="", file=sys.stderr,
                      flush=True)
        w.close()
        os.replace(tmp, out)
        print(f"\nwrote {out} ({out.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)
    finally:
        if tmp.exists():
            tmp.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3moe")
    parser.add_argument("--layers", type=int, help="default: the real model's (48 or 24)")
    parser.add_argument("--experts", type=int, help="experts a layer (default: the real model's, 128 or 32)")
    parser.add_argument("--tokenizer", type=Path, help="a Qwen2.5 / Qwen3 GGUF whose tokenizer to copy "
                        "(default: the default draft's, from `offspec setup`)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from offspec.models.default_pair import DEFAULT_PAIR, gguf_path

        tokenizer = gguf_path(DEFAULT_PAIR["draft"])
    if not Path(tokenizer).is_file():
        print(f"error: no tokenizer GGUF at {tokenizer}; run `python main.py setup` or pass --tokenizer",
              file=sys.stderr)
        return 2
    try:
        _, _, layers, experts = FAMILIES[args.family]
        write_twin(args.out, args.layers or layers, args.experts or experts, Path(tokenizer), args.seed, args.family)
    except KeyboardInterrupt:
        print("\ninterrupted: nothing written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
