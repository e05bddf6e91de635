"""`offspec models`: list the models in offspec's cache; `offspec models rm NAME` removes one.

The listing shows each entry's name, family (config.json), weight types (its manifest), size on disk and a
tokenizer fingerprint (a hash of its vocabulary): entries with the same fingerprint share a tokenizer, so one can
draft for the other. A default pair member's GGUF is shown in the GGUF column. `rm` takes exact names only; it
removes a default member's GGUF too only with --with-gguf (the next start fetches it again: 1.6 GB for both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from offspec.errors import run_cli
from offspec.models.catalog import CachedModel, as_dict, find, list_cache, remove, shared_tokenizers
from offspec.util.paths import cache_dir
from offspec.util.sizes import format_size

FINGERPRINT_SHOWN = 8  # hex digits of the tokenizer fingerprint in the table (the JSON has all 16)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec models", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sub = p.add_subparsers(dest="action", metavar="{list,rm}")
    ls = sub.add_parser("list", help="list the cached models (the default)")
    ls.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object")
    rm = sub.add_parser("rm", help="remove cached models, named exactly as `offspec models` lists them")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a name from the listing (exact)")
    rm.add_argument("--with-gguf", action="store_true",
                    help="also remove a default pair member's GGUF (downloaded or assembled once; the next start "
                         "fetches it again)")
    rm.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object")
    return p


def _types(row: CachedModel) -> str:
    return ",".join(row.weight_types) or "-"


def _table(rows: list[CachedModel], root: Path) -> str:
    header = ("NAME", "FAMILY", "TYPES", "SIZE", "GGUF", "TOKENIZER", "")
    lines = [header]
    for row in rows:
        notes = [f"default {row.default_role}"] if row.default_role else []
        if row.kind in ("packed", "self"):
            notes.append(row.source)
        if row.status != "ok":
            notes.append(row.status)
        lines.append((row.name, row.family or "-", _types(row), format_size(row.size) if row.size else "-",
                      format_size(row.gguf_size) if row.gguf else "-",
                      row.tokenizer[:FINGERPRINT_SHOWN] or "-", "; ".join(notes)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + ("  " + line[-1] if line[-1] else "")
           for line in lines]
    out = [line.rstrip() for line in out]
    for fp, names in shared_tokenizers(rows).items():
        out.append(f"same tokenizer ({fp[:FINGERPRINT_SHOWN]}): {', '.join(names)}")
    total = sum(r.total_size for r in rows)
    out.append(f"{len(rows)} model(s), {format_size(total)} in {root}")
    return "\n".join(out)


def _list(args: argparse.Namespace, root: Path) -> int:
    rows = list_cache(root)
    if args.json:
        print(json.dumps({"cache_dir": str(root), "models": [as_dict(r) for r in rows],
                          "shared_tokenizers": shared_tokenizers(rows),
                          "total_size": sum(r.total_size for r in rows)}))
    elif rows:
        print(_table(rows, root))
    else:
        print(f"no models in {root} yet; `offspec setup` fetches the default pair")
    return 0


def _rm(args: argparse.Namespace, root: Path) -> int:
    rows = list_cache(root)
    chosen = [find(rows, name) for name in dict.fromkeys(args.names)]  # every name checked before removing any
    for row in chosen:
        if row.kind == "gguf" and not args.with_gguf:
            remove(row)  # raises the one-line error that says to add --with-gguf
    removed = []
    for row in chosen:
        freed = remove(row, with_gguf=args.with_gguf)
        removed.append({"name": row.name, "freed": freed})
        if not args.json:
            kept = f"; its GGUF stays ({format_size(row.gguf_size)}, {row.gguf}): the next start converts it again, " \
                   f"--with-gguf removes it too" if row.gguf and not args.with_gguf else ""
            print(f"removed {row.name} ({format_size(freed)} freed){kept}")
    if args.json:
        print(json.dumps({"cache_dir": str(root), "removed": removed, "freed": sum(r["freed"] for r in removed)}))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    root = cache_dir()
    if args.action == "rm":
        return _rm(args, root)
    return _list(args, root)
