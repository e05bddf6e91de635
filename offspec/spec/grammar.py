"""Output constrained by a grammar (a JSON schema, a Lark grammar), lossless under speculation.

At every emitted position the target's token is chosen from its logits with the tokens the grammar forbids after
the tokens before it masked out (`TokenChooser` asks `TokenGrammar.allowed()`, then `advance()`s with the token it
chose). The target alone under the same mask makes exactly the same choice (greedy) or draws from exactly the same
distribution (sampling), so verification stays lossless: a tree node the grammar forbids is never the target's
choice. Drafters ask for the masks along their tree's paths (`TokenGrammar.paths()`), so that they propose only
tokens the grammar allows; that only shapes the tree.

The masks come from llguidance (the grammar engine of llama.cpp, vLLM and SGLang), over the target's token ids:
about 0.1 ms a mask for a JSON schema over Qwen2.5's 152k tokens. Its tokenizer view is built once per tokenizer
(`grammar_tokenizer`, about 1-3 s for 152k tokens).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterable, Optional, Sequence, Union

import llguidance
import numpy as np
import torch

from offspec.errors import OffspecError

# JSON as models write it (Python's json.dumps spacing), and no free whitespace: a model may otherwise loop on
# newlines inside an object. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Union[dict, str, bool]) -> str:
    """llguidance's grammar for output that is one JSON value following `schema` (a dict, its JSON text, or True /
    {} for any JSON object)."""
    if schema is True or schema == {}:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise OffspecError(f"the JSON schema is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                               f"{exc.colno})") from None
    if not isinstance(schema, dict):
        raise OffspecError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise OffspecError(f"the JSON schema cannot be used: {exc}") from None


def lark_grammar(lark: str) -> str:
    """llguidance's grammar from a Lark grammar (llguidance's dialect: `%json {...}` embeds a JSON schema, a bare
    `<name>` is a special token)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, over `vocab_size` ids (the target's logits: ids past the
    tokenizer's own are never allowed); `eos_ids` end the output where the grammar is complete."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise OffspecError("constrained output needs a fast (tokenizers) tokenizer, and this model's is a slow one")
    backend = copy.copy(backend)  # the settings below stay off the generator's own tokenizer
    backend.no_padding()
    backend.no_truncation()
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))
    except Exception as exc:  # llguidance refuses a tokenizer it cannot map to bytes
        raise OffspecError(f"this model's tokenizer cannot be used for constrained output: {exc}") from None


class TokenGrammar:
    """The grammar's state after the tokens emitted so far, and the masks it allows from there."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int):
        self.vocab_size = vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise OffspecError(f"the output grammar cannot be used: {_first_line(self._matcher.get_error())}")
        self._bits: Optional[bytes] = None  # the mask at the current state (packed, as llguidance gives it) ...
        self._allowed: Optional[torch.Tensor] = None  # ... and unpacked: each computed once per state

    def _packed(self) -> bytes:
        if self._bits is None:
            self._bits = self._matcher.compute_bitmask()
        return self._bits

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        if self._allowed is None:
            self._allowed = unpack(self._packed(), self.vocab_size)
        return self._allowed

    def advance(self, token: int) -> None:
        """`token` was emitted (an allowed one: the chooser masked the others out)."""
        if not self._matcher.consume_token(int(token)):
            raise OffspecError(f"the output grammar refused token {token}: "
                               f"{_first_line(self._matcher.get_error())}")
        self._bits = self._allowed = None

    @property
    def finished(self) -> bool:
        """Nothing but an end-of-sequence token may follow."""
        return self._matcher.is_stopped()

    def paths(self) -> "GrammarPaths":
        """Masks and checks along token paths from the current state (a drafter's tree), on a copy of the state."""
        return GrammarPaths(self._matcher.deep_copy(), self.vocab_size, self._packed())


class GrammarPaths:
    """A copy of the grammar's state that walks token paths from the state it was made at: the masks at tree
    nodes (`allowed_after`) and which candidate nodes the grammar allows (`allowed_nodes`). Paths are lists of
    token ids after that state (the tree's root is the state itself: the path []). Walking from one path to the
    next rolls back to their common prefix only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, root: bytes):
        self._matcher, self.vocab_size = matcher, vocab_size
        self._path: list[int] = []  # the tokens consumed from the start state
        self._bits: dict[tuple[int, ...], Optional[bytes]] = {(): root}  # packed masks by path (None: forbidden)

    def _goto(self, path: Sequence[int]) -> bool:
        """Move the state to the end of `path`; False (and back at the common prefix) if a token is forbidden."""
        common = 0
        for a, b in zip(self._path, path):
            if a != b:
                break
            common += 1
        if common < len(self._path):
            self._matcher.rollback(len(self._path) - common)
            del self._path[common:]
        rest = list(path[common:])
        if rest:
            n = self._matcher.try_consume_tokens(rest)  # stops before a forbidden token, without an error state
            self._path.extend(rest[:n])
            if n < len(rest):
                return False
        return True

    def allowed_after(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """(k, vocab_size) bool: the tokens allowed after each of the k paths (none after a forbidden path)."""
        out = torch.zeros((len(paths), self.vocab_size), dtype=torch.bool)  # (k, V)
        for i in sorted(range(len(paths)), key=lambda i: paths[i]):  # neighbours share prefixes
            bits = self._mask_after(tuple(paths[i]))
            if bits is not None:
                out[i] = unpack(bits, self.vocab_size)
        return out

    def _mask_after(self, path: tuple[int, ...]) -> Optional[bytes]:
        """The packed mask after `path`, None where the path itself is forbidden."""
        if path not in self._bits:
            self._bits[path] = self._matcher.compute_bitmask() if self._goto(path) else None
        return self._bits[path]

    def allowed_nodes(self, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """For candidate nodes (parents before children; parent -1: the start state), whether the grammar allows
        each one's path: its token after its parent's path, and its parent allowed."""
        ok: list[bool] = []
        paths: list[list[int]] = []
        for token, parent in zip(tokens, parents):
            base = paths[parent] if parent >= 0 else []
            paths.append(base + [int(token)])
            if parent >= 0 and not ok[parent]:
                ok.append(False)
                continue
            bits = self._bits.get(tuple(base), b"")
            if bits:
                ok.append(int(token) < 8 * len(bits) and bool(bits[int(token) >> 3] >> (int(token) & 7) & 1))
            else:
                ok.append(self._goto(base) and self._matcher.validate_tokens([int(token)]) == 1)
        return ok


def unpack(bits: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit i of little-endian 32-bit words: token i) -> (vocab_size,) bool."""
    flags = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:vocab_size]
    out = torch.from_numpy(flags.astype(bool))
    if out.numel() < vocab_size:  # a tokenizer view smaller than the logits: the rest is never allowed
        out = torch.cat([out, torch.zeros(vocab_size - out.numel(), dtype=torch.bool)])
    return out


def _first_line(text: str) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else "unknown error"
