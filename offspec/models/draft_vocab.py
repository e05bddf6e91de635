"""A draft model's reduced vocabulary (FR-Spec): its LM head computes the rows of the most frequent tokens only.

The draft's LM head is a large share of a draft step and of its memory: the default draft's Q8_0 head is
146 MB of its 393 MB of weights read per step (151,936 rows), 3.4 of 16.5 ms of a one-node step on 2 AVX-512
cores. `--draft-vocab` keeps the rows of the K most frequent tokens (65,536 by default) and of the tokenizer's
special tokens (end of turn among them), gathered once at load, and then gives a row to every token the
conversation uses (`SubsetHead.admit`: the identifiers of code a user pastes are often rare tokens, and copying
them is where long drafts pay), read from the full head memory-mapped from the draft's weight store, so the full
head does not stay in memory. The draft can propose only the tokens that have a row. The target still scores
every token with its full head, so the output is unchanged (lossless): what changes is only what the draft can
propose.

How frequent a token is comes from a ranks table (`offspec/data/token_ranks/*.json`, or
`<config dir>/token_ranks/*.json`) written by `scripts/token_ranks.py`, for one tokenizer: the table names the
tokenizer's fingerprint (a hash of its vocabulary) and is used only with that vocabulary.

`--draft-vocab auto` (the default) keeps 65,536 tokens where a table matches the draft's tokenizer and the whole
head otherwise; `--draft-vocab N` keeps N (a table is needed); `--draft-vocab full` keeps the whole head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.ggml import KERNEL_TYPES
from offspec.formats.modules import QLinear
from offspec.offload.hostmem import MADV_DONTNEED, advise
from offspec.util.paths import config_dir

from .fingerprint import fingerprint_vocab

RANKS_FORMAT = "offspec-token-ranks"
DEFAULT_SIZE = 65536  # rows kept by `auto`: the default pair accepts as much as with the whole head (docs/benchmarks.md)
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "token_ranks"  # offspec/data/token_ranks


def vocab_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (every token and its id): a ranks table is only used with it."""
    return fingerprint_vocab(tokenizer.get_vocab())


def _tables() -> list[Path]:
    found: list[Path] = []
    for where in (config_dir() / "token_ranks", SHIPPED):
        if where.is_dir():
            found += sorted(where.glob("*.json"))
    return found


def read_ranks(path: Path) -> dict:
    """A ranks table, checked: one OffspecError line naming the file where it is unreadable or malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OffspecError(f"cannot read the token ranks table {path}: {exc}; delete it or write it again with "
                           f"scripts/token_ranks.py") from None
    ids = data.get("ids") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != RANKS_FORMAT or not isinstance(data.get("tokenizer"), str)
            or not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)
            or len(set(ids)) != len(ids)):
        raise OffspecError(f"{path} is not a token ranks table (format {RANKS_FORMAT}: tokenizer, distinct ids >= 0); "
                           f"delete it or write it again with scripts/token_ranks.py")
    return data


def find_ranks(fingerprint: str) -> Optional[tuple[list[int], Path]]:
    """The ranked token ids of the first table for this tokenizer fingerprint (the config dir's first), or None."""
    for path in _tables():
        data = read_ranks(path)
        if data["tokenizer"] == fingerprint:
            return data["ids"], path
    return None


def choose_ids(tokenizer: Any, setting: Union[str, int], vocab_size: int) -> Optional[torch.Tensor]:
    """The (n,) sorted long ids a draft head keeps under `setting` (offspec.config.draft_vocab_setting's), or None for the whole head.

    `vocab_size`: the head's rows (may exceed the tokenizer's, padded). The tokenizer's special tokens are always
    kept: a draft must be able to propose the end of a turn."""
    if setting == "full":
        return None
    size = DEFAULT_SIZE if setting == "auto" else int(setting)
    if size >= vocab_size:
        return None
    found = find_ranks(vocab_fingerprint(tokenizer))
    if found is None:
        if setting == "auto":
            return None
        raise OffspecError(f"draft_vocab {size}: no token ranks table matches the draft's tokenizer; use "
                           f"--draft-vocab full, or count one with scripts/token_ranks.py into "
                           f"<config dir>/token_ranks/")
    ranked, _ = found
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    keep = {i for i in ranked[:size] if i < vocab_size} | {i for i in special if 0 <= i < vocab_size}
    if len(keep) >= vocab_size:
        return None
    return torch.tensor(sorted(keep), dtype=torch.long)  # (n,) ascending token ids


EXTRA_ROWS = 8192  # rows a reduced head keeps free for tokens the conversation uses (`SubsetHead.admit`)
GATHER_ROWS = 4096  # rows a reduced head copies at a time when it is made (a multiple of the 16 interleaved together)


def _weight_of(head: nn.Module) -> Optional[torch.Tensor]:
    """The (rows, ...) weight rows of a QLinear (`qweight`: ggml blocks) or an nn.Linear; None for other heads."""
    if isinstance(head, QLinear):
        return kernels.stored_rows(head)  # row-major blocks: rows are gathered by token
    if type(head) is nn.Linear and not head.weight.is_meta:
        return head.weight.detach()
    return None


class SubsetHead(nn.Module):
    """An LM head reduced to some of its rows: the `ids` chosen at load (the most frequent tokens and the special
    ones), then every token the conversation uses as it comes (`admit`: identifiers of code that was given are
    rare tokens, and copying them is where long drafts pay), up to EXTRA_ROWS more; `forget` drops those.

    `subset(x)` gives the (..., n) logits of the rows in use, in the order of `ids[:n]` (the draft runner's
    path); `forward(x)` gives (..., vocab_size) logits, -inf elsewhere, so the model stays a causal LM that proposes
    only these tokens (transformers' own generate, e.g. `offspec bench --budgets hf`). `source` holds the full
    head's rows, read again only to admit a token: memory-mapped from the draft's weight store where it has one."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int, source: Optional[torch.Tensor] = None,
                 extra: int = EXTRA_ROWS, source_mapped: bool = False):
        super().__init__()
        # the full head's rows, row-major: `source` where given (then a head interleaved for the CPU kernels is not
        # copied back to rows only to be dropped)
        weight = _weight_of(head) if source is None else source
        self.source = weight  # (vocab_size, ...) the full head's rows
        self.type_id = getattr(head, "type_id", None)  # ggml blocks (QLinear), or None: float rows (nn.Linear)
        self.in_features = head.in_features
        self.vocab_size = vocab_size
        self.static = int(ids.numel())
        capacity = min(vocab_size, self.static + extra)
        device = head.qweight.device if isinstance(head, QLinear) else weight.device  # where the head computes
        # (capacity, ...) rows in use
        self.register_buffer("rows", torch.empty((capacity, *weight.shape[1:]), dtype=weight.dtype, device=device))
        bias = getattr(head, "bias", None)
        self.register_buffer("bias_rows", None if bias is None else bias.detach().new_zeros(capacity))
        self.full_bias = None if bias is None else bias.detach().clone()  # (vocab_size,) a few KB
        if bias is not None:
            self.bias_rows[: self.static] = self.full_bias[ids.to(device)]
        self.register_buffer("ids", torch.full((capacity,), -1, dtype=torch.long, device=device), persistent=False)
        self.ids[: self.static] = ids.to(device)  # (capacity,) token id of each row; -1 past n
        self.n = self.static
        self._known = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab_size,) host: which tokens have a row
        self._known[ids.cpu()] = True
        # the rows chosen at load interleaved for the CPU kernels, as a resident head's are (formats.kernels
        # .interleave); the rows admitted later stay row-major after them, computed apart
        self.static_interleaved = (self.type_id is not None and device.type == "cpu" and self.static >= 16
                                   and KERNEL_TYPES[self.type_id].name in kernels.X16_NAMES and kernels.interleaves())
        # a draft's head: its products as the draft's layers' (kernels.as_draft)
        self.x16_type = None if self.type_id is None else \
            self.type_id + (kernels.X16S_TYPES if getattr(head, "sums", False) else kernels.X16_TYPES)
        self._gather(weight, ids, mapped=source is not None and source_mapped)

    def _gather(self, weight: torch.Tensor, ids: torch.Tensor, mapped: bool) -> None:
        """Copy the rows chosen at load into `rows` (interleaved where `static_interleaved`), GATHER_ROWS at a
        time: no temporary copy of them all, and from a read-only file mapping (`mapped`: a store's full head;
        ids ascending) the pages read so far are let go as it goes (MADV_DONTNEED would zero an anonymous one).
        A 0.5B Qwen2.5 draft's 65k rows of 152k, gathered at once, paged the whole head in and copied the rows
        twice: the 1 GB budget's process peaked ~50 MB higher, while loading."""
        ascending = bool((ids[1:] > ids[:-1]).all())
        for start in range(0, self.static, GATHER_ROWS):
            part = ids[start : start + GATHER_ROWS]
            out = self.rows[start : start + part.numel()]  # (k, ...) contiguous
            out.copy_(weight.index_select(0, part.to(weight.device)))  # a chunk's temporary only
            if self.static_interleaved:  # 16 rows at a time: a chunk (a multiple of 16 rows) is its own groups
                out.copy_(kernels.compiled().interleave(out, self.type_id, self.in_features, True))
            if mapped and ascending and weight.device.type == "cpu":
                advise(weight[: int(part[-1])], MADV_DONTNEED)  # rows before the last one read: never read here again

    def admit(self, tokens: Sequence[int]) -> int:
        """Give the tokens in `tokens` that have no row yet one (while rows are left); returns how many were added."""
        new = torch.tensor(sorted({t for t in tokens if 0 <= t < self.vocab_size}), dtype=torch.long)  # (u,)
        if new.numel():
            new = new[~self._known[new]][: self.rows.shape[0] - self.n]
        k = int(new.numel())
        if k:
            device = self.rows.device
            self.rows[self.n : self.n + k] = self.source.index_select(0, new.to(self.source.device)).to(device)
            if self.bias_rows is not None:
                self.bias_rows[self.n : self.n + k] = self.full_bias[new.to(device)]
            self.ids[self.n : self.n + k] = new.to(device)
            self._known[new] = True
            self.n += k
        return k

    def forget(self) -> None:
        """Back to the rows chosen at load."""
        self._known[self.ids[self.static : self.n].cpu()] = False
        self.ids[self.static : self.n] = -1
        self.n = self.static

    @property
    def token_ids(self) -> torch.Tensor:
        return self.ids[: self.n]  # (n,)

    def subset(self, x: torch.Tensor) -> torch.Tensor:
        if self.static_interleaved:
            return self._subset_interleaved(x)
        rows = self.rows[: self.n]
        bias = None if self.bias_rows is None else self.bias_rows[: self.n]
        if self.type_id is not None:
            return kernels.linear(x, rows, self.type_id, self.in_features, bias)  # (..., n)
        if x.device.type == "cpu" and 1 < x.numel() // x.shape[-1] <= 256:  # skinny: see offspec/formats/cpu_linear.py
            y = torch.mm(rows, x.reshape(-1, x.shape[-1]).t()).t()  # (m, n)
            y = (y + bias if bias is not None else y).reshape(*x.shape[:-1], self.n)
            return y.contiguous()
        return nn.functional.linear(x, rows, bias)  # (..., n)

    def _subset_interleaved(self, x: torch.Tensor) -> torch.Tensor:
        """`subset` where the rows chosen at load are interleaved: those, then the admitted ones (row-major)."""
        s, n = self.static, self.n
        bias = (None, None) if self.bias_rows is None else (self.bias_rows[:s], self.bias_rows[s:n])
        y = kernels.linear(x, self.rows[:s], self.x16_type, self.in_features, bias[0])  # (..., s)
        if n == s:
            return y
        admitted = kernels.linear(x, self.rows[s:n], self.type_id, self.in_features, bias[1])  # (..., n - s)
        return torch.cat([y, admitted], dim=-1)  # (..., n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.subset(x)  # (..., n)
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))  # (..., vocab_size)
        return out.index_copy_(-1, self.token_ids.to(part.device), part)

    def extra_repr(self) -> str:
        return f"{self.n} of {self.vocab_size} rows ({self.static} chosen at load)"


def _storage(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.is_meta else t.untyped_storage().data_ptr()


def restrict_head(model: nn.Module, ids: torch.Tensor, source: Optional[torch.Tensor] = None,
                  source_mapped: bool = False) -> Optional[SubsetHead]:
    """Swap `model`'s LM head for a SubsetHead of the rows `ids`, and let the full head's memory go: tensors that
    shared its buffer (a GGUF draft's final norm sits in the same resident payload) get their own copies. A head
    tied to the token table keeps the table (the embeddings read it). `source`: the full head's rows kept for
    admitting tokens later (default: the head's own weight, which then stays); `source_mapped`: it is a read-only
    file mapping, whose pages may go once read. None, nothing changed, for a head of another kind (bitsandbytes)."""
    head = model.get_output_embeddings()
    if isinstance(head, QLinear):
        rows = head.out_features
    else:
        weight = _weight_of(head)
        if weight is None:
            return None
        rows = int(weight.shape[0])
    sub = SubsetHead(head, ids, rows, source, source_mapped=source_mapped)
    model.set_output_embeddings(sub)
    emb = model.get_input_embeddings()
    tied = _storage(getattr(emb, "qweight", None) if hasattr(emb, "qweight") else getattr(emb, "weight", None))
    shared = _storage(head.qweight if isinstance(head, QLinear) else weight)
    if source is not None and shared is not None and shared != tied:
        for module in model.modules():
            if module is sub:
                continue
            for store in (module._parameters, module._buffers):
                for name, t in list(store.items()):
                    if _storage(t) == shared:
                        copy = t.detach().clone()
                        store[name] = nn.Parameter(copy, requires_grad=False) if isinstance(t, nn.Parameter) else copy
    return sub


def head_rows(model: nn.Module) -> Optional[torch.Tensor]:
    """The (n,) token ids a reduced head computes now, or None for a whole head."""
    head = model.get_output_embeddings()
    return head.token_ids if isinstance(head, SubsetHead) else None


def reduce_draft_head(model: nn.Module, tokenizer: Any, setting: Union[str, int],
                      source: Optional[torch.Tensor] = None, source_mapped: bool = False) -> Optional[str]:
    """Apply `setting` (offspec.config.draft_vocab_setting's) to a loaded draft: its head keeps the chosen rows.
    Returns a line for the progress display, or None where the whole head stays. `source`: the full head's rows to
    admit tokens from later (default: the head's own, which then stays in memory; `source_mapped`: a read-only file
    mapping). A head that cannot be reduced is an OffspecError when a count was asked for, and stays whole under
    `auto`."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None) or int(model.config.vocab_size)
    ids = choose_ids(tokenizer, setting, rows)
    if ids is None:
        return None
    if restrict_head(model, ids, source, source_mapped) is None:
        if setting == "auto":
            return None
        raise OffspecError(f"draft_vocab {setting}: the draft's LM head ({type(head).__name__}) cannot be reduced; "
                           f"use --draft-vocab full")
    return (f"draft vocabulary: its LM head scores {ids.numel():,} of {rows:,} tokens (the most frequent and the "
            f"special ones) and those the conversation uses (--draft-vocab full: all)")
