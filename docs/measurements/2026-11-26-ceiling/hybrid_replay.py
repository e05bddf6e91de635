"""A hybrid's per-pass choice replayed offline: the real suffix drafter (as in suffix_replay.py) or a draft chain of k
tokens, whose acceptance is exact from the draft's teacher-forced ranks (draft_ranks.json: a chain takes the tokens
where the draft's top-1 is right), timed by ceiling.txt's cost model; a model pass also pays the draft's catch-up on
the tokens it has not seen (the prompt first) at DTOK seconds a token (an assumption: a third of the target's
prefill rate). Policies: suffix only, model only, the better of the two per pass in hindsight (oracle), the suffix
where its cut keeps a node (n>1), the suffix where its match is confident or keeps 3 nodes (conf).

    python docs/measurements/2026-11-26-ceiling/hybrid_replay.py
"""
import json
import sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.argv = [sys.argv[0]]
exec(open(HERE / "suffix_replay.py").read().split("if __name__")[0])
R = {r["prompt"]: r["ranks"] for r in json.load(open(HERE / "draft_ranks.json"))}
D = 0.0348; DTOK = 0.004  # the draft's one-node step (ceiling.txt), its catch-up per token
def sim(policy, k=3, verbose=False):
    d = SuffixDrafter(SuffixConfig(), "cpu")
    T_ar = T = 0.0; P = 0; kinds = {}
    for r, p in zip(runs, ENC):
        out = r["token_ids"]; ranks = R[r["prompt"]]; d.forget(); d.reset([], p, 0)
        cfg = TreeConfig(budget=32, confident_budget=32, max_depth=32, drafter="suffix", pass_cost=pc)
        i = 0; lag = len(p)  # the draft has not seen the prompt
        while i < len(out):
            n, path = replay_pass(d, p + out[:i], out, i, cfg)
            s_tok = min(len(path), len(out) - i)
            s_cost = (interp(F, n) + interp(H, s_tok)) if n > 1 else F[1] + H[1]
            a = chain_acc(ranks, i, k)
            m_tok = min(a + 1, len(out) - i)
            m_cost = max(0, lag - 1) * DTOK + k * D + interp(F, k + 1) + interp(H, m_tok)
            if policy == "suffix": use = "s"
            elif policy == "model": use = "m"
            elif policy == "oracle": use = "s" if s_tok / s_cost >= m_tok / m_cost else "m"
            elif policy == "n>1": use = "s" if n > 1 else "m"
            elif policy == "conf": use = "s" if d.confident or n > 3 else "m"
            kinds[use] = kinds.get(use, 0) + 1
            if use == "s":
                d.observe(path, len(path)); T += s_cost; i += s_tok; lag += s_tok
            else:
                d._verified = None; T += m_cost; i += m_tok; lag = 1
        T_ar += len(out) * (F[1] + H[1])
    Pt = sum(pre[:len(runs)])
    return (T_ar + Pt) / (T + Pt), kinds
for pol in ("suffix", "model", "oracle", "n>1", "conf"):
    for k in ((2, 3, 4, 6) if pol != "suffix" else (3,)):
        s, kinds = sim(pol, k)
        print(f"{pol:8s} k={k}: {s:.2f}x {kinds}", flush=True)
