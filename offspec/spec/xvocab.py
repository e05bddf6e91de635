"""A draft with another tokenizer (heterogeneous vocabularies): its context and its proposals, mapped through text.

Pure host code over token ids and bytes (no model inside; `MappedDrafter`, offspec/spec/mapped_drafter.py, runs it
around a draft model):

- `VocabMapping`: the two tokenizers' token texts (offspec/spec/token_text.py), and what each side's special tokens
  stand for on the other side (an added token of the same content, the draft's end of text for the target's, the
  target's BOS for nothing: the draft puts its own where its tokenizer does).
- `DraftContext`: the committed target tokens as the draft's tokens. The committed text grows by the target's
  tokens; the draft's tokens are kept where their text still agrees with it, and the text after them is encoded
  with the draft's tokenizer together with the last WINDOW draft tokens before it, so a token boundary that moves
  when text is appended ("Hel" + "lo" -> "Hello") is taken back: the draft's KV cache keeps the tokens that stay
  (`sync` says how many), and runs the others again. An incomplete UTF-8 character at the end of the committed
  text waits (`pending`) until the rest of it is committed.
- `map_tree`: a tree of draft tokens -> a tree of target tokens. Each draft node's path is text; the text is encoded
  with the target's tokenizer along it (one draft token may make several target tokens, several draft tokens one,
  and a path may end inside a target token). The target tokens of a path's last word (as the target's
  pre-tokenizer splits words) could still change when the text goes on (" Hel" is "ĠHel", " Hello" one token
  "ĠHello"), so they are kept only as weaker candidates (`trailing`: their score is the path's plus log(trailing);
  0 drops them); an added token (an end of turn) is whole. The paths are merged into one trie of target tokens,
  each node scored by the best draft path through it (a draft path's cumulative log-probability), and the best
  `budget` nodes are kept. Scores never increase along a path of the trie, so the kept nodes form a tree.

The target verifies the tree as any other (offspec/spec/verify.py): every emitted token is the target's own choice,
so a mapping that proposes badly costs speed, never correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .token_text import TokenTexts, complete_utf8

WINDOW = 8  # draft tokens before new text that are encoded again with it (only those that change are run again)
RESTART = 2  # a draft node's text is encoded again from this many of its parent's target tokens back
TRAILING = 0.5  # the weight of the target tokens of a path's last word, which more text could change (0: dropped)


class VocabMapping:
    """The token texts of a target and a draft tokenizer, and what their special tokens stand for across."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any):
        self.target, self.draft = TokenTexts(target_tokenizer), TokenTexts(draft_tokenizer)
        target, draft = self.target, self.draft
        # a committed target token as text in the draft's context: its own text, BOS none
        self.context_bytes = list(target.bytes)
        if target.bos_id is not None and 0 <= target.bos_id < len(target):
            self.context_bytes[target.bos_id] = b""
        # a draft token as text in a proposal, or None: a special token the target has nothing for ends the path
        self.proposal_bytes: list[Optional[bytes]] = [b if b else None for b in draft.bytes]
        for i in draft.added:
            content = draft.bytes[i].decode("utf-8", errors="replace")
            if content in target.by_content:
                continue  # the target's added token of the same content (its encoder recognises it in text)
            if i == draft.eos_id and target.eos_id is not None:
                self.proposal_bytes[i] = target.bytes[target.eos_id]  # end of text for end of text
            elif i in draft.special:
                self.proposal_bytes[i] = None

    def context_text(self, target_ids: Sequence[int]) -> bytes:
        table = self.context_bytes
        return b"".join(table[i] if 0 <= i < len(table) else b"" for i in target_ids)

    def summary(self) -> str:
        return (f"through text: {len(self.draft.tokenizer):,} draft tokens, {len(self.target.tokenizer):,} target "
                f"tokens")


def _common_prefix(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Length of the longest common prefix of two byte strings (a few C-level compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftContext:
    """The draft's tokens for the committed target tokens, kept incrementally (see the module doc)."""

    def __init__(self, mapping: VocabMapping, window: int = WINDOW):
        self.mapping, self.window = mapping, window
        self.target_ids: list[int] = []  # the committed target tokens `text` holds
        self.target_ends: list[int] = []  # where each ends in `text`
        self.text = bytearray()  # the committed text
        self.ids: list[int] = []  # the draft's tokens
        self.ends: list[Optional[int]] = []  # where each ends in `spelled`; None: inside a block that is not aligned
        self.spelled = bytearray()  # the draft tokens' text (after `observe`, it may run past `text`)
        draft = mapping.draft
        self.fixed = 1 if draft.adds_bos else 0  # the draft's BOS stays first
        if self.fixed:
            self.ids, self.ends = [draft.bos_id], [0]

    @property
    def pending(self) -> bytes:
        """Committed bytes the draft's tokens do not hold yet: an incomplete UTF-8 character."""
        return bytes(self.text[len(self.spelled):])

    def _offset(self, j: int) -> Optional[int]:
        """Where boundary j (before draft token j) is in the text; None inside a block that is not aligned."""
        return 0 if j == 0 else self.ends[j - 1]

    def _boundary(self, limit: int, upto: int) -> int:
        """The last boundary j <= `upto` (and >= the fixed BOS) at a byte offset <= `limit` that starts a character."""
        for j in range(min(upto, len(self.ids)), self.fixed, -1):
            off = self._offset(j)
            if off is not None and off <= limit and (off >= len(self.spelled) or self.spelled[off] & 0xC0 != 0x80):
                return j
        return self.fixed

    def sync(self, target_ids: Sequence[int]) -> int:
        """Make `target_ids` the committed tokens. Returns how many of the draft's tokens before the call are still
        its first tokens (its KV cache keeps those)."""
        n = len(self.target_ids)
        if list(target_ids[:n]) == self.target_ids:
            common = n
        else:
            common = 0
            for a, b in zip(self.target_ids, target_ids):
                if a != b:
                    break
                common += 1
        cut = self.target_ends[common - 1] if common else 0
        del self.text[cut:], self.target_ids[common:], self.target_ends[common:]
        table = self.mapping.context_bytes
        for t in target_ids[common:]:
            self.text += table[t] if 0 <= t < len(table) else b""
            self.target_ids.append(t)
            self.target_ends.append(len(self.text))
        agree = _common_prefix(self.spelled, self.text)
        j = self._boundary(agree, len(self.ids))  # the draft's tokens up to j still spell committed text
        end = complete_utf8(bytes(self.text[-4:])) + max(0, len(self.text) - 4)  # up to an incomplete character
        if j == len(self.ids) and len(self.spelled) == end:
            return j  # nothing new
        start = self._boundary(agree, max(self.fixed, j - self.window))  # re-encode the window and what is new
        off = self._offset(start)
        piece = bytes(self.text[off:end]).decode("utf-8", errors="replace")
        draft = self.mapping.draft
        new = draft.encode_within([piece])[0] if piece else []
        aligned = new is not None
        if new is None:  # the encoder changes this text (a normalizer): one block, cut only at its ends
            new = draft.encode(piece)
        k = 0
        old = self.ids[start:]
        while k < min(len(old), len(new)) and old[k] == new[k]:  # the same tokens: their cache entries stay
            k += 1
        del self.ids[start:], self.ends[start:], self.spelled[off:]
        for i, t in enumerate(new):
            self.spelled += draft.bytes[t] if 0 <= t < len(draft) else b""
            self.ids.append(t)
            self.ends.append(len(self.spelled) if aligned or i == len(new) - 1 else None)
        return start + k

    def append(self, draft_ids: Sequence[int]) -> None:
        """Draft tokens of an accepted proposal go on the draft's context (their cache entries were kept)."""
        table = self.mapping.proposal_bytes
        for t in draft_ids:
            self.spelled += table[t] or b""
            self.ids.append(t)
            self.ends.append(len(self.spelled))


@dataclass
class MappedTree:
    """`map_tree`'s result: the target nodes after the root, in an order where parents come first."""

    tokens: list[int]  # target token ids
    parents: list[int]  # each node's parent: 0 is the root, k >= 1 the node tokens[k - 1]
    scores: list[float]  # cumulative log-probabilities of the best draft path through each node
    texts: list[Optional[bytes]]  # each draft node's text after the draft's context (None: not text the target takes)


def _node_texts(mapping: VocabMapping, tokens: Sequence[int], parents: Sequence[int],
                pending: bytes) -> list[Optional[bytes]]:
    """Each draft node's text after the draft's context (the root's: b""), or None: a path through a special token
    the target has nothing for, or one that does not spell the `pending` bytes first."""
    table = mapping.proposal_bytes
    texts: list[Optional[bytes]] = [b""] + [None] * (len(tokens) - 1)
    for i in range(1, len(tokens)):
        t, up = tokens[i], texts[parents[i]]
        piece = table[t] if 0 <= t < len(table) else None
        text = None if up is None or piece is None else up + piece
        if text is not None and not (text.startswith(pending) if len(text) >= len(pending)
                                     else pending.startswith(text)):
            text = None
        texts[i] = text
    return texts


Encoding = tuple[list[int], list[int], int]  # target tokens, where each ends, where the last word starts (bytes)


def _encode_nodes(target: TokenTexts, texts: list[Optional[bytes]], parents: Sequence[int]
                  ) -> list[Optional[Encoding]]:
    """Each node's text, to its last whole character, as target tokens with their byte ends and where its last word
    starts (`TokenTexts.last_word`: the tokens ending after it could still change): None where it is no text the
    target's tokenizer spells. A node's encoding is its parent's, encoded again from RESTART tokens back (a boundary
    that moves as text is appended), in one batched call per tree level."""
    n = len(texts)
    out: list[Optional[Encoding]] = [([], [], 0)] + [None] * (n - 1)
    depth = [0] * n
    levels: dict[int, list[int]] = {}
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        levels.setdefault(depth[i], []).append(i)
    sizes = target.sizes
    for level in sorted(levels):
        jobs = []  # (node, tokens kept from the parent, where the new piece starts, the piece)
        for i in levels[level]:
            t = texts[i]
            if t is None:
                continue
            whole = t[:complete_utf8(t)]
            ids_p, ends_p, _ = out[parents[i]] or ([], [], 0)  # a parent without an encoding: from the start
            r = max(0, len(ids_p) - RESTART)
            while r > 0 and (ends_p[r - 1] >= len(whole) or whole[ends_p[r - 1]] & 0xC0 == 0x80):
                r -= 1  # restart at a whole character
            off = ends_p[r - 1] if r else 0
            try:
                jobs.append((i, r, off, whole[off:].decode("utf-8")))
            except UnicodeDecodeError:
                continue  # bytes that are no text (the draft's byte tokens out of order)
        pieces = sorted({piece for *_, piece in jobs if piece})
        encoded = dict(zip(pieces, target.encode_within(pieces)))
        encoded[""] = []
        words = {piece: target.last_word(piece) for piece in pieces}
        for i, r, off, piece in jobs:
            new = encoded[piece]
            if new is None:
                continue
            ids_p, ends_p, word_p = out[parents[i]] or ([], [], 0)
            ends, at = ends_p[:r], off
            for token in new:
                at += sizes[token] if 0 <= token < len(sizes) else 0
                ends.append(at)
            word = words.get(piece)
            if word is None:  # no pre-tokenizer: the last token alone could change
                word = ends[-2] if len(ends) > 1 else 0
            elif word > 0:
                word += off
            else:  # the piece is one word: the parent's last word goes on (a word never starts earlier)
                word = min(word_p, off)
            out[i] = (ids_p[:r] + new, ends, word)
    return out


def map_tree(mapping: VocabMapping, tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float],
             pending: bytes, budget: int, trailing: float = TRAILING) -> MappedTree:
    """A draft tree (host lists, node 0 its root; parents before children) -> the best `budget` nodes of the trie of
    target tokens its paths spell (see the module doc). `pending`: committed bytes the draft has not seen (an
    incomplete character): a draft path must begin with them, and the target tokens that spell them are not new."""
    n = len(tokens)
    texts = _node_texts(mapping, tokens, parents, pending)
    encoded = _encode_nodes(mapping.target, texts, parents)
    added = mapping.target.added
    log_trailing = math.log(trailing) if trailing > 0 else None
    keys: dict[tuple[int, int], int] = {}  # (trie parent, token) -> trie node
    node_tokens, node_parents, node_scores = [0], [-1], [0.0]  # trie node 0: the root
    proposed: list[list[int]] = [[] for _ in range(n)]  # each draft node's new target tokens
    paths: list[list[int]] = [[] for _ in range(n)]  # the trie nodes of those it put in at its full score
    for i in range(1, n):
        if encoded[i] is None:
            continue
        ids, ends, word = encoded[i]
        k = 0
        if pending:  # the tokens that spell the pending bytes are committed: the path's new tokens come after
            while k < len(ids) and ends[k] < len(pending):
                k += 1
            if k == len(ids) or ends[k] != len(pending):
                continue  # a target token spans the committed bytes and new ones: no proposal from here
            k += 1
        new = proposed[i] = ids[k:]
        if not new:
            continue
        # the tokens of the last word could change with more text (unless it ends with an added token): weaker
        full = len(new) if new[-1] in added else sum(1 for e in ends[k:] if e <= word)
        # the parent's trie nodes where both paths have the same tokens: the parent's score there is no lower
        up, up_path = proposed[parents[i]], paths[parents[i]]
        c = 0
        while c < min(len(up_path), full) and up[c] == new[c]:
            c += 1
        path = paths[i] = up_path[:c]
        at = path[-1] if path else 0
        for k in range(c, len(new) if log_trailing is not None else full):
            weight = scores[i] if k < full else scores[i] + log_trailing
            child = keys.get((at, new[k]))
            if child is None:
                child = len(node_tokens)
                keys[(at, new[k])] = child
                node_tokens.append(new[k])
                node_parents.append(at)
                node_scores.append(weight)
            elif weight > node_scores[child]:
                node_scores[child] = weight
            if k < full:
                path.append(child)
            at = child
    # the best `budget` nodes (ties: the earlier node, so a parent, which scores at least its child, comes first)
    kept = sorted(sorted(range(1, len(node_tokens)), key=lambda k: (-node_scores[k], k))[:budget])
    index = {0: 0}
    for k in kept:
        index[k] = len(index)
    return MappedTree(tokens=[node_tokens[k] for k in kept], parents=[index[node_parents[k]] for k in kept],
                      scores=[node_scores[k] for k in kept], texts=texts)
