"""Tiny random real models (Llama, Qwen2) saved as safetensors with a character tokenizer, for tests.

They go through the real loading code: `save_tiny_model(...)` writes a Hugging Face directory that
`offspec.load(target=str(path), ...)` reads like any other local model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
BASE_VOCAB = len(SPECIALS) + 256  # specials + one token per byte (two of them merges': see MERGES)
# merges, as every real byte-level BPE vocabulary has (transformers 5.0 to 5.17 cannot build a GGUF's BPE tokenizer
# from an empty merge list, nor read back a list of one: tests/test_gguf_tokenizer.py): "ÀÀ" (bytes C0 C0) in the
# place of "Á" (byte C1), "öö" (F6 F6) in the place of "õ" (F5). None of these bytes ever occurs in UTF-8, so every
# text still encodes one token per byte, with the ids it had.
MERGES = [("À", "À"), ("ö", "ö")]
REPLACED = {"Á": "ÀÀ", "õ": "öö"}  # the unreachable byte tokens the merges' tokens take the places of
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(vocab_size: int = BASE_VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte of any text: MERGES never fires). `vocab_size` >= BASE_VOCAB pads
    with `<xN>`."""
    from tokenizers import pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = [REPLACED.get(c, c) for c in sorted(ByteLevel.alphabet())]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = BASE_VOCAB, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_pos: int = 512):
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(arch)


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 0, vocab_size: int = BASE_VOCAB,
                    logit_scale: float = 1.0, noise: float = 0.0, **config_kw) -> Path:
    """Build a random model from a config and save it (safetensors) with the byte tokenizer into `path`.

    `logit_scale` multiplies the LM head so the next-token distributions are sharper (> 1) or flatter (< 1).
    `noise` > 0 perturbs every weight of the model `seed` would give: a draft that mostly agrees with it.
    """
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size=vocab_size, **config_kw)
    cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    model = cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(logit_scale)
        if noise > 0:
            gen = torch.Generator().manual_seed(10_000 + seed)
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path
