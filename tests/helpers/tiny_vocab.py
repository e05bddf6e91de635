"""Tokenizers that differ from tests/helpers/tiny.py's, and tiny models over them: pairs of another vocabulary.

- `merged_tokenizer(merges, seed)`: byte-level BPE (GPT-2 word splitting) with the given merges, its token ids
  shuffled by `seed` (the specials too: the same contents at other ids);
- `save_with_tokenizer(path, tokenizer, ...)`: a tiny random model whose vocabulary is that tokenizer's;
- `save_twin(target_dir, path, tokenizer)`: the target's model with its token rows moved to `tokenizer`'s ids for the
  same text (a draft of another vocabulary that agrees with the target on every token).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from .tiny import CHAT_TEMPLATE, SPECIALS, save_tiny_model

# merges over the byte-level alphabet ("Ġ" is the space): the target's and the draft's differ
TARGET_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("e", "r"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at"),
                 ("Ã", "©")]
DRAFT_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "l"), ("el", "l"), ("Ġ", "c"), ("o", "r")]


def merged_tokenizer(merges: Sequence[tuple[str, str]] = (), seed: int = 0, ascii_only: bool = False
                     ) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with `merges`; `seed` > 0 shuffles every id (seed 0 keeps tiny.py's order).
    `ascii_only`: its bytes are printable ASCII, space and newline only, so a random model's output is text (text
    passes from one vocabulary to the other; random bytes need not be text)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if ascii_only:
        ascii_chars = {chr(b) for b in range(0x21, 0x7F)} | {"Ġ", "Ċ"}  # "Ġ": the space, "Ċ": the newline
        alphabet = [c for c in alphabet if c in ascii_chars]
        merges = [(a, b) for a, b in merges if set(a + b) <= ascii_chars]
    pieces = SPECIALS + alphabet + [a + b for a, b in merges if a + b not in alphabet]
    ids = list(range(len(pieces)))
    if seed:
        random.Random(seed).shuffle(ids)
    vocab = dict(zip(pieces, ids))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_with_tokenizer(path: Path, tokenizer: PreTrainedTokenizerFast, **model_kw) -> Path:
    """A tiny random model (tiny.py's `save_tiny_model`) whose vocabulary and special ids are `tokenizer`'s."""
    path = save_tiny_model(path, vocab_size=len(tokenizer), **model_kw)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(path)
    _special_ids(path, tokenizer)
    return path


def _special_ids(path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """The model's config and generation config name the tokenizer's bos/eos/pad ids (the end of a reply)."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            data.update(ids)
            file.write_text(json.dumps(data, indent=2))


def save_twin(target_dir: Path, path: Path, tokenizer: PreTrainedTokenizerFast, noise: float = 0.0) -> Path:
    """The target's model with its token embeddings and LM head rows at `tokenizer`'s ids for the same token text
    (`tokenizer` has the target's tokens, other ids): through text, it predicts what the target does."""
    target_tok = PreTrainedTokenizerFast.from_pretrained(str(target_dir))
    mine = tokenizer.get_vocab()
    order = torch.tensor([mine[piece] for piece, _ in sorted(target_tok.get_vocab().items(), key=lambda kv: kv[1])])
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            moved = torch.empty_like(weight)
            moved[order] = weight[: len(order)]  # target id i -> the twin's id for the same text
            weight.copy_(moved)
        if noise > 0:
            gen = torch.Generator().manual_seed(1234)
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen))
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _special_ids(path, tokenizer)
    return path
