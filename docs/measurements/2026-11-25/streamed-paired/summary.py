"""Totals and per-prompt ratios of runs.json (python summary.py)."""
import collections
import json
import statistics
from pathlib import Path

runs = json.loads((Path(__file__).parent / "runs.json").read_text())["runs"]
for w in ("code", "mt"):
    tot, per = collections.defaultdict(collections.Counter), collections.defaultdict(dict)
    for r in (r for r in runs if r["workload"] == w):
        for k in ("tokens", "seconds", "passes", "draft_seconds", "target_seconds"):
            tot[r["variant"]][k] += r[k]
        per[r["prompt"]][r["variant"]] = r["tokens"] / r["seconds"]
    for v, c in tot.items():
        print(f"{w} {v:19s} tokens/pass {c['tokens'] / c['passes']:.2f}  tokens/s {c['tokens'] / c['seconds']:.2f}  "
              f"draft s/pass {c['draft_seconds'] / c['passes']:.3f}  target s/pass {c['target_seconds'] / c['passes']:.3f}")
    for a in ("draft-vocab", "draft-vocab+extras"):
        ratios = [per[i][a] / per[i]["base"] for i in sorted(per)]
        print(f"{w} {a} / base per prompt: median {statistics.median(ratios):.3f}:", " ".join(f"{x:.2f}" for x in ratios))
