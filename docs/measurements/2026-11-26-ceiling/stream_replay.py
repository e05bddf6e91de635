"""Tokens per pass where a pass costs the same for any tree (a streamed target): a draft chain of B tokens (exact from
draft_ranks.json), and that chain merged with the suffix drafter's uncut candidates, up to B, 32 or 64 of them
(a path is accepted along whichever of the two the target follows, so a pass takes the longer of the two).

    python docs/measurements/2026-11-26-ceiling/stream_replay.py
"""
import json
import sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.argv = [sys.argv[0]]
exec(open(HERE / "suffix_replay.py").read().split("if __name__")[0])
R = {r["prompt"]: r["ranks"] for r in json.load(open(HERE / "draft_ranks.json"))}
def run(B, extra, n_prompts=20):
    d = SuffixDrafter(SuffixConfig(), "cpu")
    tot_tok = tot_pass = 0
    for r, p in list(zip(runs, ENC))[:n_prompts]:
        out = r["token_ids"]; ranks = R[r["prompt"]]; d.forget(); d.reset([], p, 0)
        cfg = TreeConfig(budget=extra, confident_budget=extra, max_depth=extra, drafter="suffix", pass_cost=None)
        i = 0
        while i < len(out):
            n, path = replay_pass(d, p + out[:i], out, i, cfg)
            s_acc = len(path) - 1
            d.observe(path, len(path))
            m_acc = chain_acc(ranks, i, B)
            acc = max(m_acc, s_acc)
            tok = min(acc + 1, len(out) - i)
            i += tok; tot_tok += tok; tot_pass += 1
    return tot_tok / tot_pass
for B in (8, 16):
    print(f"model chain {B}: {run(B, 0):.2f} tok/pass; + suffix <= {B}: {run(B, B):.2f}; + suffix <= 32: {run(B, 32):.2f}; <= 64: {run(B, 64):.2f}", flush=True)
