"""A GGUF's tokenizer, giving llama.cpp's token ids: transformers builds it from the file, then offspec makes it
split off, before anything else and each at its GGUF id, every token llama.cpp splits off a prompt (its "special
tokens cache", llama-vocab.cpp): the control tokens (type 3, special here), the user-defined ones (type 4, split
even where special tokens are not parsed) and the unknown one (type 2). tests/test_gguf_tokenizer.py checks the ids
against llama.cpp's own on four real files (tests/data/gguf_token_ids.json, made by scripts/tokenizer_check.py).

A token is registered under the GGUF's own string, the one llama.cpp matches in a prompt, and never gets a new id:
- where transformers' vocabulary holds it under that string (every such token of Qwen2.5 and SmolLM2), as it is;
- where it holds it under another (Gemma-3's 30 runs of spaces: "    ", id 140, held as "▁▁▁▁", the form its
  normalizer gives spaces), that vocabulary entry takes the GGUF's string, and the merges that form the old one go:
  llama.cpp looks tokens up by the GGUF's strings, so "▁▁▁▁" typed in a prompt is never id 140 there either.
  Registered under "    " as it was, the token got a new id past the model's 262,144 (262,174 tokens): an
  IndexError at the first indented line of code;
- anything else (a string held at another id, a vocabulary that is not BPE) is an OffspecError, as is a token
  that does not land at its GGUF id. (What transformers itself appends stays: its qwen2 converter adds an
  "<|endoftext|>" to a GGUF that has none, as the tiny test GGUFs; no GGUF at hand lacks the tokens it adds.)
llama.cpp also splits off the normal tokens it takes for an end of turn or a FIM marker by their text: "</s>" is one
of Qwen2.5's (one token in llama.cpp, "</", "s", ">" in transformers). They are registered too, but not special:
they are ordinary text to the model's own tokenizer, and decode as text.

And for the byte-level BPE vocabularies that llama.cpp pre-splits into single digits first (its "smollm" pre-
tokenizer and 7 others), where transformers' GGUF tokenizer has only GPT-2's split: "x,\n     2" ends in "\n     ",
"2" in llama.cpp (the run of spaces before a digit stays whole) and "\n    ", " 2" in transformers. offspec adds
the digit split, as SmolLM2's own tokenizer.json has it.

transformers 5.24 registers the control and user-defined tokens itself; 5.0 to 5.17 register only those its
converter for the architecture names (the qwen2 converter: "<|endoftext|>", "<|im_start|>", "<|im_end|>"):
Qwen2.5-Coder's GGUF had its other 17 control tokens and its "<tool_call>" encoded byte by byte there.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from offspec.errors import OffspecError

# GGUF metadata value types (the file format's enum) and the fixed sizes of the scalar ones
STRING, ARRAY = 8, 9
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # token types (gguf.TokenType)

# The texts by which llama.cpp (llama-vocab.cpp, llama-cpp-python 0.3.36) makes a normal token control: end-of-turn,
# end-of-generation and FIM markers. (It promotes only the first it finds of each FIM and end-of-turn kind, and only
# where the GGUF names none; on the files at hand each found in a prompt is one token either way.)
LLAMA_CPP_CONTROL = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|eom_id|>", "<|return|>", "<|call|>",
    "<|flush|>", "<|calls|>", "</s>", "<eos>", "<turn|>", "<|tool_response>", "[e~[",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
])
# llama.cpp's pre-tokenizers that split off each digit before GPT-2's split ("\\p{N}" first)
DIGITS_FIRST = frozenset(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"])


class Vocab(NamedTuple):
    tokens: list[str]  # in id order
    types: list[int]  # token types, in id order
    pre: str  # tokenizer.ggml.pre: llama.cpp's pre-tokenizer ("" where the GGUF names none)


def gguf_tokenizer(gguf: Path) -> Any:
    """transformers' tokenizer of the GGUF at `gguf`, splitting a prompt into llama.cpp's tokens (module doc)."""
    from transformers import AutoTokenizer

    with _without_gpt_oss_rope_keys():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    vocab = gguf_vocab(gguf)
    _register(tokenizer, vocab, gguf.name)
    _split_digits(tokenizer, vocab)
    return tokenizer


@contextmanager
def _without_gpt_oss_rope_keys() -> Iterator[None]:
    """transformers' GGUF reader (which its tokenizer loading runs whole) fails on a gpt-oss file's rope scaling keys
    (it takes a key's length array for its value): within this context the gguf package's reader leaves them out.
    offspec reads a gpt-oss config itself (formats/gguf_config.gpt_oss_config), so only the tokenizer comes from
    transformers here."""
    import gguf as gguf_py

    original = gguf_py.GGUFReader

    class Reader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith("gpt-oss.rope.scaling.")]:
                del self.fields[key]

    gguf_py.GGUFReader = Reader
    try:
        yield
    finally:
        gguf_py.GGUFReader = original


def _register(tokenizer: Any, vocab: Vocab, name: str) -> None:
    """Register each token llama.cpp splits off (module doc) that transformers has not, at its GGUF id."""
    from transformers import AddedToken

    added = tokenizer.added_tokens_decoder  # {id: AddedToken}
    new: dict[bool, list] = {True: [], False: []}  # special or not -> tokens
    ids: dict[str, int] = {}  # the GGUF's string -> its id
    renames: dict[str, str] = {}  # transformers' string -> the GGUF's
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types)):
        promoted = kind == NORMAL and text in LLAMA_CPP_CONTROL
        if (kind not in (UNKNOWN, CONTROL, USER_DEFINED) and not promoted) or i in added:
            continue
        held = tokenizer.convert_ids_to_tokens(i)
        if held is None:
            raise OffspecError(f"{name}'s token {i} ({text!r}) is past the end of transformers' vocabulary of it")
        if held != text:
            renames[held] = text
        special = kind in (UNKNOWN, CONTROL)
        new[special].append(AddedToken(text, special=special, normalized=False))
        ids[text] = i
    if renames:
        _rename(tokenizer, renames, name)
    for special, group in new.items():
        if group:
            tokenizer.add_tokens(group, special_tokens=special)
    moved = [(c, i) for c, i in ids.items() if tokenizer.convert_tokens_to_ids(c) != i]
    if moved:
        content, i = moved[0]
        raise OffspecError(f"{name}'s token {i} ({content!r}) got id {tokenizer.convert_tokens_to_ids(content)} in "
                           f"transformers' tokenizer ({len(moved)} such)")


def _rename(tokenizer: Any, renames: dict[str, str], name: str) -> None:
    """Give the vocabulary entries `renames` names the GGUF's strings; drop the merges that use the old ones."""
    from tokenizers.models import BPE

    backend = tokenizer.backend_tokenizer
    model = json.loads(backend.to_str())["model"]
    if model["type"] != "BPE":
        raise OffspecError(f"{name}: transformers holds {len(renames)} of its special tokens under other strings "
                           f"(such as {next(iter(renames))!r}), in a {model['type']} vocabulary offspec cannot rename")
    held = model["vocab"]
    clash = next((new for new in renames.values() if new in held), None)
    if clash is not None:
        raise OffspecError(f"{name}'s token {clash!r} is held at two ids by transformers' tokenizer")
    for old, new in renames.items():
        held[new] = held.pop(old)
    pairs = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]  # [a, b] or "a b" (older files)
    merges = [(a, b) for a, b in pairs if a not in renames and b not in renames and a + b not in renames]
    options = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
               "ignore_merges")
    backend.model = BPE(vocab=held, merges=merges, **{k: model[k] for k in options if model.get(k) is not None})


def _split_digits(tokenizer: Any, vocab: Vocab) -> None:
    """Each digit split off first where llama.cpp's pre-tokenizer does so and transformers' does not (module doc)."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    split = backend.pre_tokenizer
    if vocab.pre in DIGITS_FIRST and split is not None and json.loads(split.__getstate__())["type"] == "ByteLevel":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split])


def marked_tokens(gguf: Path) -> tuple[list[str], list[str]]:
    """(control tokens, user-defined tokens) of the GGUF's vocabulary (token types 3 and 4), in id order."""
    tokens, types, _ = gguf_vocab(gguf)
    return ([t for t, k in zip(tokens, types) if k == CONTROL], [t for t, k in zip(tokens, types) if k == USER_DEFINED])


def gguf_vocab(gguf: Path) -> Vocab:
    """The GGUF's vocabulary (empty for a file that is no GGUF). Reads the header's key-value pairs only
    (gguf's GGUFReader parses every field and tensor: 19 s for Qwen2.5's)."""
    import mmap
    import struct

    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            return Vocab([], [], "")
        pos = 24  # magic, version (u32), tensor count (u64)
        count = struct.unpack_from("<Q", data, 16)[0]
        tokens: list[bytes] = []
        types: list[int] = []
        pre = b""

        def string(at: int) -> tuple[bytes, int]:
            n = struct.unpack_from("<Q", data, at)[0]
            return data[at + 8 : at + 8 + n], at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind == STRING:
                return string(at)[1]
            return at + SCALAR_BYTES[kind]

        for _ in range(count):
            key, pos = string(pos)
            kind = struct.unpack_from("<I", data, pos)[0]
            pos += 4
            if kind == STRING and key == b"tokenizer.ggml.pre":
                pre, pos = string(pos)
                continue
            if kind != ARRAY:
                pos = skip(kind, pos)
                continue
            sub, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if key == b"tokenizer.ggml.tokens" and sub == STRING:
                for _ in range(n):
                    token, pos = string(pos)
                    tokens.append(token)
            elif key == b"tokenizer.ggml.token_type" and sub in SCALAR_BYTES and SCALAR_BYTES[sub] == 4:
                types = list(struct.unpack_from(f"<{n}i", data, pos))
                pos += 4 * n
            elif sub == STRING:
                for _ in range(n):
                    pos = string(pos)[1]
            else:
                pos += SCALAR_BYTES[sub] * n
    return Vocab([t.decode("utf-8", errors="replace") for t in tokens], types, pre.decode("utf-8", errors="replace"))
