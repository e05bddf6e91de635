"""How the copy + tree oracle of ceiling.py moves with the costs: the draft step and the prefill scaled from what
ceiling.txt measured (the pass and head times as measured), on the same replies, ranks and copy runs.

    python docs/measurements/2026-11-26-ceiling/sensitivity.py
"""
import json
import sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.argv = [sys.argv[0]]
exec(open(HERE / "suffix_replay.py").read().split("if __name__")[0])
sys.path.insert(0, str(HERE))
from ceiling import schedule, copy_runs  # noqa: E402
R = {r["prompt"]: r["ranks"] for r in json.load(open(HERE / "draft_ranks.json"))}
Ff = lambda x: interp(F, x); Hf = lambda x: interp(H, x)
data = []
for r, p in zip(runs, ENC):
    out = r["token_ids"]; data.append((len(out), copy_runs(p + out, len(p)), R[r["prompt"]]))
for label, dscale, prescale in (("as measured", 1.0, 1.0), ("draft step 0.7x", 0.7, 1.0), ("draft 0.7x, no prefill", 0.7, 0.0), ("draft 0.5x, prefill 0.5x", 0.5, 0.5)):
    D = 0.0348 * dscale
    tot_ar = tot_h = 0.0
    for (n, C, ranks), pf in zip(data, pre):
        pf *= prescale
        tot_ar += pf + n * (F[1] + H[1]); tot_h += pf + schedule(n, Ff, Hf, D, C, ranks, True)
    print(f"{label}: copy+tree oracle {tot_ar / tot_h:.2f}x", flush=True)
