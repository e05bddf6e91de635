"""The model families offspec runs from GGUF files, and the config values transformers' GGUF reader leaves out.

transformers reads a GGUF's config through a fixed table per architecture; some values a model computes with are
not in it, so transformers falls back to its config class's defaults where llama.cpp (the reference every GGUF is
made for) reads the file. `complete_config` sets them from the GGUF's own metadata, as llama.cpp reads them:

- the head dimension (`attention.key_length`; qwen3's is not hidden / heads);
- gemma2 / gemma3: the attention scale (llama.cpp: 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B
  models), gemma2's attention and final logit soft-capping, gemma3's final soft-capping, the local layers' rope
  base (`rope.freq_base_swa`) and pattern (`attention.sliding_window_pattern`), and no local layers at all where
  the file has no sliding window;
- phi3: a partial rotary embedding (`rope.dimension_count` below the head dimension), and no sliding window
  (llama.cpp leaves Phi-3's window off);
- mistral (which llama.cpp writes as a llama file): no sliding window, as llama.cpp runs it;
- the mixtures of experts: the experts' rows (`expert_feed_forward_length`) and qwen2moe's shared expert's
  (`expert_shared_feed_forward_length`), and whether the top-k weights are renormalized as llama.cpp computes
  them (qwen3moe: yes; qwen2moe: no); a llama file with experts is Mixtral (`mixtral_config`), which transformers
  reads as a llama model without its experts;
- gpt-oss: its whole config (`gpt_oss_config`): transformers' GGUF reader fails on the file's rope keys. The YaRN
  rope is the OpenAI reference's, not llama.cpp's (see `gpt_oss_config`);
- llama 3.1+: the rope frequency factors the file holds as a tensor (`rope_freqs.weight`), as transformers' "llama3"
  rope parameters that reproduce them (llama.cpp's converter computes them from those parameters).

`FAMILIES` names the families by transformers model type; `VERIFIED` are those whose conversion the test suite
checks against transformers' own model of the same file (tests/test_families.py). A GGUF of another architecture
that transformers reads converts too, and says on its load line that it is not verified.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

# transformers model type -> family name
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
            "qwen2_moe": "qwen2moe", "mixtral": "mixtral", "gpt_oss": "gpt-oss"}
# llama.cpp's top-k weights, renormalized or not, by GGUF architecture (its build_moe_ffn's norm_w)
_MOE_NORMALIZED = {"qwen3moe": True, "qwen2moe": False}
VERIFIED = frozenset(FAMILIES.values())
# llama.cpp's layer counts of the 27B gemmas, whose attention scale is 1/sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def family_of(config: Any) -> Optional[str]:
    """The family of a transformers config, or None for an architecture outside `FAMILIES`."""
    return FAMILIES.get(getattr(config, "model_type", ""))


def gguf_fields(reader: Any) -> dict[str, Any]:
    """The metadata of a gguf.GGUFReader as {key: value} (arrays of strings and numbers as lists)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a value gguf cannot decode: not one this module reads
            continue
    return out


def complete_config(config: Any, fields: Mapping[str, Any], rope_freqs: Optional[np.ndarray] = None) -> list[str]:
    """Set the values of `config` (transformers' config of a GGUF) that transformers does not read from its
    metadata `fields` (`gguf_fields`) and its `rope_freqs.weight` tensor (float32, or None); returns "name=value"
    for each value changed, or a sentence for what it cannot reproduce."""
    arch = str(fields.get("general.architecture", ""))
    changed: list[str] = []

    def get(key: str) -> Any:
        return fields.get(f"{arch}.{key}")

    def put(name: str, value: Any) -> None:
        if getattr(config, name, None) != value:
            setattr(config, name, value)
            changed.append(f"{name}={value}")

    key_length = get("attention.key_length")
    if key_length and hasattr(config, "head_dim"):
        put("head_dim", int(key_length))
    model_type = getattr(config, "model_type", "")
    if arch in _MOE_NORMALIZED:
        if get("expert_feed_forward_length"):
            put("moe_intermediate_size", int(get("expert_feed_forward_length")))
        if arch == "qwen2moe" and get("expert_shared_feed_forward_length"):
            put("shared_expert_intermediate_size", int(get("expert_shared_feed_forward_length")))
        put("norm_topk_prob", _MOE_NORMALIZED[arch])
    if arch in _GEMMA_27B_LAYERS:
        heads = config.num_attention_heads
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
        put("query_pre_attn_scalar", config.hidden_size // heads if big else config.head_dim)
        window = get("attention.sliding_window")
        if arch == "gemma2":  # llama.cpp's defaults where the file says nothing
            put("attn_logit_softcapping", float(get("attn_logit_softcapping") or 50.0))
            put("final_logit_softcapping", float(get("final_logit_softcapping") or 30.0))
            put("sliding_window", int(window or 4096))
        else:
            cap = get("final_logit_softcapping")
            put("final_logit_softcapping", float(cap) if cap else None)
            _gemma3_local_layers(config, window, get("attention.sliding_window_pattern"), put)
            base = get("rope.freq_base_swa")
            rope = getattr(config, "rope_parameters", None)
            if base and isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict):
                if rope["sliding_attention"].get("rope_theta") != float(base):
                    rope["sliding_attention"]["rope_theta"] = float(base)
                    changed.append(f"sliding rope_theta={float(base)}")
    if model_type == "phi3":
        n_rot = get("rope.dimension_count")
        head_dim = config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None)
        if n_rot and int(n_rot) != head_dim and isinstance(rope, dict):
            factor = int(n_rot) / head_dim
            if rope.get("partial_rotary_factor") != factor:
                rope["partial_rotary_factor"] = factor
                changed.append(f"partial_rotary_factor={factor}")
        put("sliding_window", None)
    if model_type == "mistral":
        put("sliding_window", None)
    if rope_freqs is not None:
        changed.append(_llama3_rope(config, np.asarray(rope_freqs, dtype=np.float64)))
    if model_type == "phi3" and fields.get("offspec.rope_factors"):  # Phi-3 128k, Phi-3.5, Phi-4-mini
        unverified(config, "its longrope frequency factors (rope_factors_long/short) are not applied")
    return changed


def mixtral_config(config: Any, fields: Mapping[str, Any], expert_rows: int) -> Any:
    """The MixtralConfig of a llama GGUF with experts (llama.cpp writes Mixtral so), from transformers' LlamaConfig
    of it, the file's `llama.expert_count` / `expert_used_count` and its experts' rows."""
    from transformers import MixtralConfig

    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    values = {k: getattr(config, k) for k in keep if getattr(config, k, None) is not None}
    return MixtralConfig(**values, intermediate_size=int(expert_rows), sliding_window=None,
                         num_local_experts=int(fields["llama.expert_count"]),
                         num_experts_per_tok=int(fields["llama.expert_used_count"]))


def gpt_oss_config(fields: Mapping[str, Any]) -> Any:
    """transformers' GptOssConfig of a gpt-oss GGUF, from its metadata as llama.cpp reads it: every other layer
    attends through the sliding window, the first one included (`attention.sliding_window_pattern`, default 2).

    The rope is YaRN as OpenAI's reference implementation computes it, and transformers' GptOss by default: the
    ramp between the correction dims is not truncated to whole dims (`truncate: False`). llama.cpp floors and ceils
    them (ggml_rope_yarn_corr_dims), so its logits drift from the reference with the position: on a tiny random
    model with exact f32 keys and values, 2e-6 of transformers' with `truncate: True` at every position, but 8e-5 at
    position 1 and 1.1e-3 at position 29 of transformers' default (docs/families.md, note [7])."""
    from transformers import GptOssConfig

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"gpt-oss.{key}")
        return default if value is None else value

    layers = int(get("block_count"))
    heads = int(get("attention.head_count"))
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        local = [bool(p) for p in pattern][:layers]
    else:
        local = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 150000.0))}
    if get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")), truncate=False,
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
    special = {f"{k}_token_id": int(fields[f"tokenizer.ggml.{k}_token_id"])
               for k in ("bos", "eos", "pad") if fields.get(f"tokenizer.ggml.{k}_token_id") is not None}
    if "pad_token_id" not in special and fields.get("tokenizer.ggml.padding_token_id") is not None:
        special["pad_token_id"] = int(fields["tokenizer.ggml.padding_token_id"])
    return GptOssConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]), hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", int(get("embedding_length")) // heads)),
        num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        sliding_window=int(window) if window else None, max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), rope_parameters=rope,
        layer_types=["sliding_attention" if flag and window else "full_attention" for flag in local],
        tie_word_embeddings=False, attention_bias=True, **special)


UNVERIFIED = "offspec_unverified"  # a config attribute (saved with it): why its conversion is not verified


def unverified(config: Any, reason: str) -> str:
    """Mark `config` as not verified against a reference, for `reason` (its load line says so); returns it."""
    setattr(config, UNVERIFIED, reason)
    return reason


def llama3_factors(base: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """The per-frequency rope divisors of llama3 rope parameters, as llama.cpp's converter writes them."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / freqs
    smooth = (context / wavelen - low) / (high - low)
    return np.where(wavelen < context / high, 1.0,
                    np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth)))


def _llama3_rope(config: Any, rope_freqs: np.ndarray) -> str:
    """Set llama3 rope parameters reproducing `rope_freqs` (llama.cpp's converter writes them from the model's
    factor, low/high frequency factors and original context: Llama 3.1-3.3 use 1, 4 and 8192)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    factor = float(rope_freqs.max())
    for low, high, context in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        if len(rope_freqs) == dim // 2 and np.allclose(llama3_factors(base, dim, factor, low, high, context),
                                                       rope_freqs, rtol=1e-5, atol=0):
            rope.update(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                        original_max_position_embeddings=context, rope_theta=base)
            config.rope_parameters = rope
            return f"llama3 rope (factor {factor:g}, original context {context})"
    return unverified(config, "its rope frequency factors (rope_freqs) match no llama3 rope parameters offspec "
                              "knows, and are not applied")


def _gemma3_local_layers(config: Any, window: Any, pattern: Any, put: Any) -> None:
    """gemma3's layer types as llama.cpp sets them: no local layers without a window; else every `pattern`-th
    layer global (default 6), or the file's per-layer list (True: local)."""
    n = config.num_hidden_layers
    if not window:
        put("layer_types", ["full_attention"] * n)
        return
    put("sliding_window", int(window))
    if isinstance(pattern, list) and len(pattern) == n:
        local = [bool(p) for p in pattern]
    else:
        every = int(pattern) if pattern else 6
        local = [i % every < every - 1 for i in range(n)]
    put("layer_types", ["sliding_attention" if flag else "full_attention" for flag in local])
