"""The rank of each greedy reply token among the default draft's candidates, teacher-forced (0: its top-1), for the
20 code edits of the `ar` run in ../2026-11-26-layers/code-edits: draft_ranks.json, read by hybrid_replay.py.

    python docs/measurements/2026-11-26-ceiling/draft_ranks.py
"""
import json, sys, torch
from pathlib import Path
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
from ceiling import hidden_states
import offspec
from offspec.util.prompts import read_prompts
bench = json.load(open(ROOT / "docs/measurements/2026-11-26-layers/code-edits/bench.json"))
runs = bench["setups"]["ar"]["runs"]
prompts = read_prompts(ROOT / "offspec/data/code_edits.jsonl")
gen = offspec.load(budget="auto")
draft = gen.engine.drafter.runner
res = []
for run in runs:
    p = gen.encode(prompts[run["prompt"]]); out = run["token_ids"]; seq = p + out
    states = hidden_states(draft, seq[:-1])[len(p) - 1:]
    logits = draft.logits(states)
    ids = draft.token_ids(torch.arange(logits.shape[-1]))
    ranks = []
    for i, t in enumerate(out):
        hit = (ids == t).nonzero()
        ranks.append(int((logits[i] > logits[i, hit[0, 0]]).sum()) if len(hit) else 10 ** 6)
    res.append({"prompt": run["prompt"], "prompt_len": len(p), "ranks": ranks})
    print(run["prompt"], sum(r == 0 for r in ranks) / len(ranks), flush=True)
json.dump(res, open(HERE / "draft_ranks.json", "w"))
