"""Which tokenizer a model has: a short fingerprint of its vocabulary (every token string and its id).

Two models with the same fingerprint tokenize text the same way, so one can draft for the other. The same hash
names the tokenizer a token ranks table was written for (offspec/models/draft_vocab.py). `file_fingerprint` reads
a saved `tokenizer.json` directly (no transformers, no tokenizer object), for listings of the cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping, Optional

TOKENIZER_FILE = "tokenizer.json"


def fingerprint_vocab(vocab: Mapping[str, int]) -> str:
    """16 hex digits of the sha256 of the (token, id) pairs in id order."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def tokenizer_json_vocab(path: Path) -> dict[str, int]:
    """Token string -> id of a `tokenizer.json` (the tokenizers library's format), added tokens included, as
    transformers' `get_vocab()` gives them. Raises ValueError (or OSError) when the file cannot be read as one."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        items = {str(k): int(v) for k, v in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the position
        items = {str(piece[0]): i for i, piece in enumerate(vocab)}
    else:
        raise ValueError(f"{path} has no vocabulary (model.vocab)")
    for token in data.get("added_tokens") or []:
        items[str(token["content"])] = int(token["id"])
    return items


def file_fingerprint(directory: Path) -> Optional[str]:
    """The vocabulary fingerprint of the tokenizer saved in `directory`, or None when it has no readable
    tokenizer.json."""
    try:
        return fingerprint_vocab(tokenizer_json_vocab(Path(directory) / TOKENIZER_FILE))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
