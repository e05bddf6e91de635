"""A suffix index over token text: the longest suffix of a context seen before, and what followed it.

`SuffixIndex` holds a token text and maps every k-gram (k = 1..key_length) to the positions right after
its occurrences, in increasing order. The longest matching suffix of a context is found from the longest
key that occurs with a continuation, then compared further back token by token (up to `max_match`): it
is exact, not a hash guess. `continuations` grows, best first, the tree of what followed those
occurrences, counting each branch (its empirical frequency).

Positions are absolute: position j is the end of a k-gram text[j-k:j] and text[j] is what followed it.
The index is updated as tokens are committed (`extend`), cut back when a conversation is edited
(`truncate`), and a bounded index drops its oldest sequences (`add_sequence` with `max_tokens`).
`SEP` separates sequences: no key, match or continuation crosses it. Pure Python: no model, no tensors.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

SEP = -1  # between the sequences of an index (token ids are >= 0)


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in an index: its length and the occurrences it continues from."""

    length: int  # tokens matched (0: nothing)
    positions: tuple[int, ...]  # absolute positions right after each occurrence (oldest first), each continued


@dataclass(frozen=True)
class Continuations:
    """A tree of continuations in best-first order: node i's parent is < i (-1: a child of the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    counts: tuple[int, ...]  # occurrences that continue along the path to each node
    total: int  # occurrences the tree was grown from


class SuffixIndex:
    def __init__(self, key_length: int = 4, max_tokens: Optional[int] = None):
        self.key_length = key_length
        self.max_tokens = max_tokens  # None: unbounded (a conversation, bounded by the context limit)
        self.text: list[int] = []  # tokens from absolute position `base` on
        self.base = 0  # absolute position of text[0]: tokens before it were evicted
        self._after: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(key_length)]  # [k-1][gram]
        self._sequences: deque[int] = deque()  # lengths of the sequences added by add_sequence (SEP included)

    # --- size ------------------------------------------------------------------------------------
    @property
    def end(self) -> int:
        """Absolute position after the last token."""
        return self.base + len(self.text)

    def __len__(self) -> int:
        return len(self.text)

    def entries(self) -> int:
        """Positions stored in the key maps (at most key_length per token): the index's memory, in entries."""
        return sum(len(v) for table in self._after for v in table.values())

    def token(self, position: int) -> int:
        """The token at an absolute position; SEP past the end or before the base."""
        i = position - self.base
        return self.text[i] if 0 <= i < len(self.text) else SEP

    # --- updates ---------------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (ids >= 0, or SEP) and index every k-gram that ends in them."""
        for t in tokens:
            self.text.append(int(t))
            n = len(self.text)
            j = self.base + n
            for k in range(1, min(self.key_length, n) + 1):
                gram = tuple(self.text[n - k : n])
                if SEP in gram:
                    break  # longer grams hold it too
                self._after[k - 1].setdefault(gram, []).append(j)

    def truncate(self, end: int) -> None:
        """Forget the tokens from absolute position `end` on (a conversation cut back to a common prefix)."""
        end = max(end, self.base)
        while self.end > end:
            n = len(self.text)
            for k in range(1, min(self.key_length, n) + 1):
                gram = tuple(self.text[n - k : n])
                if SEP in gram:
                    break
                table = self._after[k - 1]
                positions = table[gram]
                positions.pop()  # the newest occurrence: this one
                if not positions:
                    del table[gram]
            self.text.pop()

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Add one sequence (e.g. an earlier generation) followed by SEP; with `max_tokens`, the oldest
        sequences are dropped until the index holds at most `max_tokens` tokens (a longer sequence keeps its tail)."""
        tokens = list(tokens)
        if self.max_tokens is not None:
            if self.max_tokens < 2:
                return
            tokens = tokens[-(self.max_tokens - 1) :]
        if not tokens:
            return
        self.extend(tokens + [SEP])
        self._sequences.append(len(tokens) + 1)
        while self.max_tokens is not None and len(self.text) > self.max_tokens:
            self._evict(self._sequences.popleft())

    def _evict(self, count: int) -> None:
        """Drop the oldest `count` tokens (whole sequences, SEP included)."""
        new_base = self.base + count
        for i in range(count):  # every gram that starts in the dropped part ends before new_base + key_length
            start = self.base + i
            for k in range(1, self.key_length + 1):
                j = start + k  # the gram text[start:j]
                if j > self.end:
                    break
                gram = tuple(self.text[i : i + k])
                if SEP in gram:
                    break
                table = self._after[k - 1]
                positions = table[gram]
                positions.pop(0)  # positions are increasing and older ones are already gone: this one
                if not positions:
                    del table[gram]
        del self.text[:count]
        self.base = new_base

    def clear(self) -> None:
        self.__init__(self.key_length, self.max_tokens)

    # --- queries ---------------------------------------------------------------------------------
    def _continued(self, j: int) -> bool:
        return j < self.end and self.token(j) != SEP

    def longest_match(self, context: Sequence[int], max_match: int, max_occurrences: int) -> Match:
        """The longest suffix of `context` (at most `max_match` tokens) that occurs in the text with a
        continuation, and the most recent `max_occurrences` of its occurrences that are continued."""
        if not context:
            return Match(0, ())
        for k in range(min(self.key_length, len(context)), 0, -1):
            gram = tuple(int(t) for t in context[-k:])
            positions = [j for j in self._after[k - 1].get(gram, ()) if self._continued(j)]
            if not positions:
                continue
            if k < self.key_length or k == len(context):
                # no longer key occurs with a continuation, so none of these matches further back
                return Match(k, tuple(positions[-max_occurrences:]))
            lengths = [self._match_back(j, context, k, max_match) for j in positions]
            best = max(lengths)
            return Match(best, tuple([j for j, m in zip(positions, lengths) if m == best][-max_occurrences:]))
        return Match(0, ())

    def _match_back(self, j: int, context: Sequence[int], known: int, max_match: int) -> int:
        """Tokens before position j that equal the end of `context`, given the last `known` of them do."""
        m = known
        limit = min(max_match, len(context))
        while m < limit:
            t = self.token(j - 1 - m)
            if t == SEP or t != context[-1 - m]:
                break
            m += 1
        return m

    def continuations(self, positions: Sequence[int], budget: int, max_depth: int) -> Continuations:
        return continuations([(self, j) for j in positions], budget, max_depth)


def continuations(occurrences: Sequence[tuple[SuffixIndex, int]], budget: int, max_depth: int) -> Continuations:
    """The `budget` most frequent continuation paths after `occurrences` ((index, position) pairs), at most
    `max_depth` tokens deep, grown best first: a node's count is how many occurrences continue along its
    path. Ties go to the branch found first; among siblings of equal count, to the one seen most recently.
    A child never counts more than its parent, so best-first order is a valid tree order."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    heap: list[tuple[int, int, int, int, list]] = []  # (-count, order, parent node, token, occurrences)
    order = 0

    def split(node: int, depth: int, group: Sequence[tuple[SuffixIndex, int]]) -> None:
        nonlocal order
        children: dict[int, list] = {}
        latest: dict[int, int] = {}
        for rank, (index, j) in enumerate(group):
            t = index.token(j + depth)
            if t == SEP:
                continue  # this occurrence ends here
            children.setdefault(t, []).append((index, j))
            latest[t] = rank
        for t in sorted(children, key=lambda t: (-len(children[t]), -latest[t])):
            heapq.heappush(heap, (-len(children[t]), order, node, t, children[t]))
            order += 1

    if budget > 0 and max_depth > 0:
        split(-1, 0, occurrences)
    depths: list[int] = []
    while heap and len(tokens) < budget:
        neg, _, parent, token, group = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        counts.append(-neg)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if depths[node] < max_depth:
            split(node, depths[node], group)
    return Continuations(tuple(tokens), tuple(parents), tuple(counts), len(occurrences))
