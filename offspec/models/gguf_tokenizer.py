"""A GGUF's tokenizer: transformers builds it from the file; offspec then registers the GGUF's control tokens as
special tokens and its user-defined tokens as added ones, so that a prompt's "<|fim_prefix|>" or "<tool_call>" is one
token under every transformers 5.x.

transformers 5.24 registers them all. 5.0 to 5.17 register only the tokens its converter for the architecture names
(the qwen2 converter: "<|endoftext|>", "<|im_start|>", "<|im_end|>"): Qwen2.5-Coder's GGUF had its other 17 control
tokens and its "<tool_call>" encoded byte by byte there (tests/test_gguf_tokenizer.py). Registering a token the
vocabulary holds adds no id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def gguf_tokenizer(gguf: Path) -> Any:
    """transformers' tokenizer of the GGUF at `gguf`, its control tokens special, its user-defined ones added."""
    from transformers import AddedToken, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    added = {t.content for t in tokenizer.added_tokens_decoder.values()} | set(tokenizer.all_special_tokens)
    control, user = marked_tokens(gguf)
    for tokens, special in ((control, True), (user, False)):
        missing = [t for t in tokens if t not in added]
        if missing:
            tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t in missing],
                                 special_tokens=special)
    return tokenizer


# GGUF metadata value types (the file format's enum) and the fixed sizes of the scalar ones
STRING, ARRAY = 8, 9
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
CONTROL, USER_DEFINED = 3, 4  # token types (gguf.TokenType)


def marked_tokens(gguf: Path) -> tuple[list[str], list[str]]:
    """(control tokens, user-defined tokens) of the GGUF's vocabulary (token types 3 and 4), in id order. Reads
    the header's key-value pairs only (gguf's GGUFReader parses every field and tensor: 19 s for Qwen2.5's)."""
    import mmap
    import struct

    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            return [], []
        pos = 24  # magic, version (u32), tensor count (u64)
        count = struct.unpack_from("<Q", data, 16)[0]
        tokens: list[bytes] = []
        types: list[int] = []

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
    marked = {CONTROL: [], USER_DEFINED: []}
    for token, kind in zip(tokens, types):
        if kind in marked:
            marked[kind].append(token.decode("utf-8", errors="replace"))
    return marked[CONTROL], marked[USER_DEFINED]
