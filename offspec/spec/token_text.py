"""The text of a tokenizer's tokens, as bytes, and its encoder for text in the middle of a sequence.

A draft with another tokenizer proposes through text (offspec/spec/xvocab.py): draft tokens become bytes, bytes
become target tokens. `TokenTexts` holds each token's bytes once per tokenizer (a table built from the
tokenizer's own vocabulary strings and decoder: byte-level BPE maps characters to bytes with GPT-2's table,
SentencePiece writes a space as "▁" and a raw byte as "<0xNN>"; added tokens are their own content), and encodes
text with the tokenizer's own encoder, checking that the tokens it gives spell exactly that text.

Bytes, not strings: a byte-level token may hold part of a UTF-8 character (a Chinese character is often two
tokens), and text cut there cannot be a Python string.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
ANCHOR = "\n"  # encoded before text whose start the encoder would otherwise change (a SentencePiece prefix space)


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others (space,
    control bytes, ...) for characters from U+0100 on ("Ġ" is the space, "Ċ" the newline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def complete_utf8(data: bytes) -> int:
    """The length of `data` without an incomplete UTF-8 character at its end (the first bytes of one)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n


class TokenTexts:
    """Every token's bytes (`bytes[id]`), the added tokens, and an encoder that checks its own output."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer of a fast one
        self.pre_tokenizer = getattr(self.backend, "pre_tokenizer", None)  # its word splitting, if any
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.added = set(added)  # ids of added tokens (special or not): whole units, never merged with text
        self.special = {i for i, t in added.items() if getattr(t, "special", True)}
        self.by_content = {str(t): i for i, t in added.items()}  # an added token's content -> its id
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
        self.bytes: list[bytes] = [b""] * size  # (size,) a model's padding rows past the tokenizer are b""
        self._fill(vocab, added)
        self.sizes = [len(b) for b in self.bytes]  # (size,) bytes per token
        probe = self.encode("a")
        self.prefix_space = self.text(probe) == b" a"  # a SentencePiece encoder that adds a space before the text
        # whether the tokenizer puts its BOS before an encoded text (Llama 3: yes; Qwen: no)
        with_bos = tokenizer.encode("a", add_special_tokens=True)
        self.adds_bos = self.bos_id is not None and bool(with_bos) and with_bos[0] == self.bos_id

    def _fill(self, vocab: dict[str, int], added: dict) -> None:
        decoder = getattr(self.backend, "decoder", None)
        style = "other"
        if decoder is not None:
            try:
                if decoder.decode(["ĠĊ"]) == " \n":
                    style = "byte-level"
                elif decoder.decode(["<0x41>"]) == "A" or decoder.decode(["a▁b"]) == "a b":
                    style = "sentencepiece"
            except Exception:  # a decoder that cannot take these pieces: decode token by token below
                style = "other"
        alphabet = byte_level_alphabet()
        for piece, i in vocab.items():
            if i in added:
                self.bytes[i] = str(added[i]).encode("utf-8")
            elif style == "byte-level":
                mapped = [alphabet.get(c) for c in piece]
                self.bytes[i] = piece.encode("utf-8") if None in mapped else bytes(mapped)
            elif style == "sentencepiece":
                match = _BYTE_TOKEN.fullmatch(piece)
                self.bytes[i] = bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")
            else:
                self.bytes[i] = self.tokenizer.decode([i]).encode("utf-8")

    def __len__(self) -> int:
        return len(self.bytes)

    def text(self, ids: Sequence[int]) -> bytes:
        """The bytes that tokens `ids` spell."""
        table = self.bytes
        return b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids)

    def last_word(self, text: str) -> Optional[int]:
        """Where the last word of `text` starts (in bytes; 0: it is all one word), as the tokenizer's pre-tokenizer
        splits text into the words it encodes one by one: appending text can change the tokens of the last word
        only. None for a tokenizer without a pre-tokenizer."""
        if self.pre_tokenizer is None:
            return None
        words = self.pre_tokenizer.pre_tokenize_str(text)
        return len(text[: words[-1][1][0]].encode("utf-8")) if len(words) > 1 else 0

    def encode(self, text: str) -> list[int]:
        """The tokenizer's own encoding of `text` (no BOS/EOS added; added tokens in the text are recognised)."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def encode_within(self, texts: list[str]) -> list[Optional[list[int]]]:
        """Each text encoded as it would be in the middle of a sequence, checked: tokens that spell exactly the
        text, or None where the encoder gives none (a normalizer that changes the text)."""
        out: list[Optional[list[int]]] = self.encode_batch(texts)
        for k, (text, ids) in enumerate(zip(texts, out)):
            if self.text(ids) != text.encode("utf-8"):
                out[k] = self._encode_fixed(text)
        return out

    def _encode_fixed(self, text: str) -> Optional[list[int]]:
        """`encode_within` where the plain encoding does not spell the text: a SentencePiece encoder that puts a
        space before it (" x" is encoded from "x"), or text encoded after ANCHOR and the anchor's tokens dropped."""
        data = text.encode("utf-8")
        if self.prefix_space and text.startswith(" "):
            ids = self.encode(text[1:])
            if self.text(ids) == data:
                return ids
        ids = self.encode(ANCHOR + text)
        spelled = b""
        for k, i in enumerate(ids):
            spelled += self.bytes[i] if 0 <= i < len(self.bytes) else b""
            if spelled.endswith(ANCHOR.encode()) and len(spelled) <= len(ANCHOR) + 1:
                rest = ids[k + 1 :]
                return rest if self.text(rest) == data else None
            if len(spelled) > len(ANCHOR) + 1:
                break
        return None
