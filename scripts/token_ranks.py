"""Estimate how often each token of a tokenizer occurs in a model's replies and write a token-ranks table: the
draft's reduced LM head (`--draft-vocab`, offspec/models/draft_vocab.py) keeps the most frequent tokens.

    pip install wordfreq   # word frequencies of running text (Wikipedia, subtitles, news, books, web)
    python scripts/token_ranks.py $(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])") \\
        $(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \\
        --tokenizer ~/.cache/offspec/models/qwen2.5-coder-0.5b-instruct-q4_k_m-<hash> \\
        --out offspec/data/token_ranks/qwen2.5.json --held-out <offspec bench outputs>/bench.json

Two sources, mixed by share of tokens (`--mix code:0.5,en:0.45,zh:0.05`):
- code: every ROOT is a directory (or file); its `.py`, `.md`, `.rst` and `.txt` files are tokenized as they are,
  at most --per-package bytes from each top directory below a root (one big package must not decide the table);
- prose: wordfreq's word frequencies of a language (`en`, `zh`, ...), each word tokenized as running text has it
  (English: " word" 75%, " Word" 20%, "Word" 5%), its tokens counted with the word's frequency.
The table keeps the --keep most frequent token ids, most frequent first (tokens never seen follow in id order: BPE
merges come roughly in order of frequency), and the tokenizer's fingerprint, so it is only ever used with the
vocabulary it was counted with. `--held-out FILE...` reports how much of the tokens of offspec bench reports
(`bench.json`: the target's own replies) the top 16k-64k cover.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offspec.models.draft_vocab import RANKS_FORMAT, vocab_fingerprint  # noqa: E402
from offspec.profile.schema import VERSION  # noqa: E402
from offspec.util.files import atomic_write  # noqa: E402

SUFFIXES = (".py", ".md", ".rst", ".txt")
SKIP = ("license", "copying", "notice", "authors", "record", "top_level", "entry_points", "requirements")


def corpus(roots: list[Path], per_package: int, max_bytes: int):
    """(path, text) of the corpus files: at most `per_package` bytes of each package, `max_bytes` in all."""
    packages: dict[str, list[Path]] = collections.defaultdict(list)
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES)
        for path in files:
            if any(path.name.lower().startswith(s) for s in SKIP) or not path.is_file():
                continue
            rel = path.relative_to(root) if root.is_dir() else Path(path.name)
            packages[f"{root}:{rel.parts[0]}"].append(path)
    used = collections.Counter()
    total = 0
    for package, files in sorted(packages.items()):
        for path in files:
            if used[package] >= per_package or total >= max_bytes:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            used[package] += len(text)
            total += len(text)
            yield path, text
    print(f"corpus: {total / 1e6:.1f} MB of text from {len(used)} packages", file=sys.stderr)


def held_out(paths: list[Path]) -> list[int]:
    """The token ids of every distinct reply in bench.json reports (one copy per prompt and reply)."""
    seen, ids = set(), []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        for setup in data.get("setups", {}).values():
            for run in setup.get("runs", []):
                key = tuple(run.get("token_ids") or ())
                if key and key not in seen:
                    seen.add(key)
                    ids.extend(key)
    return ids


def code_counts(tok, roots: list[Path], per_package: int, max_bytes: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    batch: list[str] = []
    for _, text in corpus(roots, per_package, max_bytes):
        batch.append(text)
        if len(batch) == 256:
            for ids in tok(batch, add_special_tokens=False)["input_ids"]:
                counts.update(ids)
            batch = []
    for ids in tok(batch, add_special_tokens=False)["input_ids"] if batch else []:
        counts.update(ids)
    return counts


def prose_counts(tok, lang: str) -> collections.Counter:
    """Token counts of running text in `lang`, from wordfreq's word frequencies."""
    try:
        from wordfreq import get_frequency_dict
    except ImportError:
        sys.exit("error: the prose counts need wordfreq: pip install wordfreq")
    words = list(get_frequency_dict(lang, wordlist="large").items())
    forms = [(" {}", str, 0.75), (" {}", str.capitalize, 0.2), ("{}", str.capitalize, 0.05)] if lang == "en" \
        else [("{}", str, 1.0)]
    counts: collections.Counter = collections.Counter()
    for fmt, case, weight in forms:
        encoded = tok([fmt.format(case(w)) for w, _ in words], add_special_tokens=False)["input_ids"]
        for (_, freq), ids in zip(words, encoded):
            for t in ids:
                counts[t] += freq * weight
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--tokenizer", required=True, help="a directory transformers' AutoTokenizer reads")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--keep", type=int, default=65536)
    ap.add_argument("--per-package", type=int, default=2_000_000)
    ap.add_argument("--max-bytes", type=int, default=150_000_000)
    ap.add_argument("--mix", default="code:0.5,en:0.45,zh:0.05", help="share of each source (code, or a language)")
    ap.add_argument("--held-out", nargs="*", type=Path, default=[])
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    mix = {name: float(share) for name, share in (part.split(":") for part in args.mix.split(","))}
    score: collections.Counter = collections.Counter()
    sizes = {}
    for name, share in mix.items():
        counts = code_counts(tok, args.roots, args.per_package, args.max_bytes) if name == "code" \
            else prose_counts(tok, name)
        total = sum(counts.values())
        sizes[name] = total
        for t, c in counts.items():
            score[t] += share * c / total
    seen = sorted(score, key=lambda t: (-score[t], t))
    rest = [t for t in range(len(tok)) if t not in score]  # never seen: in id order
    ranked = (seen + rest)[: args.keep]
    print(f"{len(score):,} distinct tokens seen; source sizes {sizes}", file=sys.stderr)
    if args.held_out:
        ids = held_out(args.held_out)
        for k in (16384, 32768, 49152, 65536):
            top = set(ranked[:k])
            share = sum(t in top for t in ids) / max(1, len(ids))
            print(f"held out ({len(ids):,} reply tokens): top {k:,} cover {100 * share:.2f}%", file=sys.stderr)
    data = {"format": RANKS_FORMAT, "version": VERSION, "tokenizer": vocab_fingerprint(tok), "vocab_size": len(tok),
            "source": f"scripts/token_ranks.py --mix {args.mix}: code = .py/.md/.rst/.txt files under "
                      f"{', '.join(r.name for r in args.roots)} ({sizes.get('code', 0):,} tokens), prose = wordfreq "
                      f"word frequencies",
            "ids": ranked}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(data, separators=(",", ":")))  # never a half-written table
    print(f"wrote {args.out}: {len(ranked):,} ids", file=sys.stderr)


if __name__ == "__main__":
    main()
