"""The suffix drafter replayed offline on the target's greedy replies (exact for greedy: a node is accepted where it
is the reply's token), timed by the cost model `ceiling.py` measured (`ceiling.txt`): variants of its proposals
compared without running a model.

    python docs/measurements/2026-11-26-ceiling/suffix_replay.py
"""
import json, re, sys, os, glob
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import interp  # noqa: E402
from offspec.config import SuffixConfig, TreeConfig
from offspec.spec.gain import PassCost
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.spec.verify import acceptance_walk
from offspec.util.prompts import read_prompts
from transformers import AutoTokenizer
from offspec.util.paths import cache_dir
txt = open(ROOT / "docs/measurements/2026-11-26-ceiling/ceiling.txt").read()
F = {int(k): float(v) / 1e3 for k, v in re.findall(r"(\d+): ([\d.]+)", txt.splitlines()[0])}
H = {int(k): float(v) / 1e3 for k, v in re.findall(r"(\d+): ([\d.]+)", txt.splitlines()[1])}
pre = [float(x) for x in re.findall(r"prefill ([\d.]+) s", txt)]
base = F[1]
pc = PassCost(base=base, per_node=0.0, head=H[1], measured=tuple((n - 1, F[n] - base) for n in sorted(F)))
gg = sorted(glob.glob(f"{cache_dir()}/**/*1.5b*.gguf", recursive=True))
tok = AutoTokenizer.from_pretrained(os.path.dirname(gg[0]), gguf_file=os.path.basename(gg[0]))
def enc(p):
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
bench = json.load(open(ROOT / "docs/measurements/2026-11-26-layers/code-edits/bench.json"))
runs = bench["setups"]["ar"]["runs"]
prompts = read_prompts(ROOT / "offspec/data/code_edits.jsonl")
ENC = [enc(prompts[r["prompt"]]) for r in runs]

def simulate(scfg=SuffixConfig(), nodes=32, verbose=False, nowaste=False, cut=True):
    d = SuffixDrafter(scfg, "cpu")
    T_ar = T_s = 0.0; ntok = npass = 0
    for r, p in zip(runs, ENC):
        out = r["token_ids"]
        d.forget(); d.reset([], p, 0)
        cfg = TreeConfig(budget=nodes, confident_budget=nodes, max_depth=nodes, drafter="suffix", pass_cost=pc if cut else None)
        i = 0; t = 0.0
        while i < len(out):
            n, path = replay_pass(d, p + out[:i], out, i, cfg)
            d.observe(path, len(path))
            emitted = min(len(path), len(out) - i)
            if nowaste: n = len(path)
            t += interp(F, n) + interp(H, emitted) if n > 1 else F[1] + H[1]
            i += emitted; npass += 1
        T_s += t; T_ar += len(out) * (F[1] + H[1]); ntok += len(out)
    P = sum(pre[:len(runs)])
    return (T_ar + P) / (T_s + P), ntok / npass


def replay_pass(d, context, out, i, cfg):
    """One pass of suffix drafter d at output position i: its tree for `context`, walked against the known reply
    (a node is accepted where it is the reply's token). Returns (tree nodes with the root, accepted path)."""
    tree = d.propose(context, cfg, 0.0, alone=True)
    n = tree.n
    tk, par = tree.tokens[:n].tolist(), tree.parents[:n].tolist()
    depth = [0] * n
    for q in range(1, n):
        depth[q] = depth[par[q]] + 1
    path, _ = acceptance_walk(tk, par, lambda q: out[i + depth[q]] if i + depth[q] < len(out) else -1)
    return n, path


def chain_acc(ranks, i, k):
    """Tokens a draft chain of k accepts from output position i: as long as the draft's top-1 (rank 0) is right."""
    a = 0
    while a < k and i + a < len(ranks) and ranks[i + a] == 0:
        a += 1
    return a


if __name__ == "__main__":
    print("default: speed-up %.2fx, %.2f tok/pass" % simulate())
    print("no waste: speed-up %.2fx, %.2f tok/pass" % simulate(nowaste=True))
    print("no cut: speed-up %.2fx, %.2f tok/pass" % simulate(cut=False))
    print("no cut no waste: speed-up %.2fx, %.2f tok/pass" % simulate(cut=False, nowaste=True))

import math
from offspec.spec.gain import ContinuationRates
class Growing(ContinuationRates):
    def observe(self, m, accepted, left):
        if m <= 0: return
        for j in range(accepted):
            self.successes[self._bucket(m + j)] += 1
        if left:
            self.failures[self._bucket(m + accepted)] += 1

def grow_probs(self, cont, m):
    # the match grows by one with each copied token: step j continues a match of m + j
    probs, depth = [], []
    for k, p in zip(cont.counts, cont.parents):
        d = 0 if p < 0 else depth[p] + 1
        q = self.rates.rate(m + d)
        depth.append(d)
        probs.append(q * (k / cont.total if p < 0 else probs[p] * (k / cont.counts[p])))
    return probs

def run_growing(**kw):
    orig_p, orig_init = SuffixDrafter._probabilities, SuffixDrafter.__init__
    def init(self, *a, **k):
        orig_init(self, *a, **k)
        self.rates = Growing(self.config.match_half, max_length=self.config.max_match)
    SuffixDrafter._probabilities, SuffixDrafter.__init__ = grow_probs, init
    try:
        return simulate(**kw)
    finally:
        SuffixDrafter._probabilities, SuffixDrafter.__init__ = orig_p, orig_init

if __name__ == "__main__":
    print("growing: speed-up %.2fx, %.2f tok/pass" % run_growing())
    print("growing, half 1: speed-up %.2fx, %.2f tok/pass" % run_growing(scfg=SuffixConfig(match_half=1.0)))

class Anchored(SuffixDrafter):
    A = 4; SKIP = 3; STRAY = 4; REANCHOR = 4
    def __init__(self, *a, **k):
        super().__init__(*a, **k); self.anchor = None; self.agree = 0; self.stray = 0
    def forget(self):
        super().forget(); self.anchor = None; self.agree = 0; self.stray = 0
    def propose(self, tokens, config, temperature=0.0, alone=True):
        conv = self.conversation
        start = conv.end
        conv.extend(tokens[conv.end:])
        for pos in range(start, len(tokens)):
            if self.anchor is None: break
            t = tokens[pos]
            if conv.token(self.anchor) == t:
                self.anchor += 1; self.agree += 1; self.stray = 0; continue
            for dlt in range(1, self.SKIP + 1):
                if conv.token(self.anchor + dlt) == t:
                    self.anchor += dlt + 1; self.stray = 0; break
            else:
                self.stray += 1
                if self.stray > self.STRAY: self.anchor = None; self.agree = 0
        return super().propose(tokens, config, temperature, alone)
    def _longest(self, tokens):
        occ, m = super()._longest(tokens)
        conv = self.conversation
        if m >= self.REANCHOR and occ and occ[-1][0] is conv:
            j = occ[-1][1]
            if self.anchor is None or conv.token(self.anchor) != conv.token(j):
                self.anchor, self.agree, self.stray = j, m, 0
            else:
                self.agree = max(self.agree, m)
        if self.anchor is not None and self.agree >= self.A and m < self.agree:
            cands = [(conv, self.anchor)]
            if self.stray and conv.token(self.anchor + 1) != conv.token(self.anchor):
                cands.append((conv, self.anchor + 1))
            cands = [(i, j) for i, j in cands if j < conv.end and conv.token(j) != -1]
            if cands:
                from offspec.spec.suffix_index import Match
                self.match = Match(self.agree, tuple(j for _, j in cands))
                return cands, min(self.agree, self.config.max_match)
        return occ, m

def run_anchored(**kw):
    import builtins
    g = globals()
    old = g["SuffixDrafter"]; g["SuffixDrafter"] = Anchored
    try: return simulate(**kw)
    finally: g["SuffixDrafter"] = old

if __name__ == "__main__":
    print("anchored: speed-up %.2fx, %.2f tok/pass" % run_anchored())
    print("anchored no cut: speed-up %.2fx, %.2f tok/pass" % run_anchored(cut=False))
    print("anchored no cut no waste: speed-up %.2fx, %.2f tok/pass" % run_anchored(cut=False, nowaste=True))
