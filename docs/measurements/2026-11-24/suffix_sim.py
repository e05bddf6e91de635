"""Offline: the suffix drafter on known greedy outputs, with a pass-cost model. tokens/pass and predicted speed."""
import json, sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from offspec.spec.suffix_drafter import SuffixDrafter
from offspec.config import SuffixConfig, TreeConfig
from offspec.spec.gain import PassCost
from offspec.spec.verify import acceptance_walk

def run(data, tree_cfg, cost, suffix_cfg=SuffixConfig(), n_tokens=128, history=False):
    d = SuffixDrafter(suffix_cfg)
    if not history: d.use_history(False)
    tot_tok = tot_pass = 0; t_spec = t_ar = 0.0; tree_passes = 0; prev = []
    for ex in data:
        prompt, out = ex["prompt_ids"], ex["output_ids"][:n_tokens]
        d.reset(prev, prompt, 0)
        tokens = list(prompt)
        while len(tokens) - len(prompt) < len(out):
            tree = d.propose(tokens, tree_cfg, 0.0)
            n = tree.n
            tk = tree.tokens[:n].tolist(); pa = tree.parents[:n].tolist()
            depth = [0] * n
            for i in range(1, n): depth[i] = depth[pa[i]] + 1
            base = len(tokens) - len(prompt)
            def choose(i):
                k = base + depth[i]
                return out[k] if k < len(out) else -5
            path, bonus = acceptance_walk(tk, pa, choose)
            new = [tk[i] for i in path[1:]] + [bonus]
            new = [t for t in new if t != -5]
            tokens.extend(new)
            d.observe(path, len(tokens))
            tot_pass += 1; tot_tok += len(new)
            t_spec += cost.seconds(n - 1, len(path))
            tree_passes += n > 1
        t_ar += len(out) * cost.seconds(0, 1)
        prev = tokens
    return tot_tok / tot_pass, t_ar / t_spec, tree_passes / tot_pass

if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    cost = PassCost(0.028, 0.0051, 0.004)
    for label, tc in [("gated b32", TreeConfig(budget=32, pass_cost=cost)),
                      ("gated b64", TreeConfig(budget=64, confident_budget=64, pass_cost=cost)),
                      ("nogate b8", TreeConfig(budget=8, confident_budget=8)),
                      ("nogate b16", TreeConfig(budget=16, confident_budget=16)),
                      ("nogate b32", TreeConfig(budget=32))]:
        tpp, speed, frac = run(data, tc, cost)
        print(f"{label}: tokens/pass {tpp:.2f}  predicted speed-up {speed:.2f}x  tree passes {frac:.0%}")
