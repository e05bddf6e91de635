"""The suffix drafter replayed offline on the target's greedy replies, timed by the cost model `ceiling.py` measured:
variants of its proposals compared without running a model.

    python scripts/replay/ceiling.py code-ar/bench.json | tee ceiling.txt        # the cost model (see ceiling.py)
    python scripts/replay/suffix_replay.py ceiling.txt code-ar/bench.json [--target MODEL]

Inputs: the output of `ceiling.py` (its first two lines, F(n) and H(rows), and each prompt's prefill) and the same
fresh `offspec bench --budgets ar` report on offspec/data/code_edits.jsonl it read (the greedy replies). Only the
target's tokenizer is loaded (default: the default pair's target, which must be set up). Exact for greedy: a node
is accepted where it is the reply's token. The real `SuffixDrafter` proposes each pass (budget 32, cut by the pass
cost as `suffix:auto` runs it); the variants: "no waste" counts only the accepted nodes' cost, "no cut" verifies
every candidate. docs/benchmarks.md has a run's figures.
"""

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]  # this checkout's offspec, and ceiling.py beside this file

from ceiling import interp  # noqa: E402

from offspec.config import SuffixConfig, TreeConfig  # noqa: E402
from offspec.models.loading import load_tokenizer  # noqa: E402
from offspec.models.sources import locate_model  # noqa: E402
from offspec.spec.gain import PassCost  # noqa: E402
from offspec.spec.suffix_drafter import SuffixDrafter  # noqa: E402
from offspec.spec.verify import acceptance_walk  # noqa: E402
from offspec.util.prompts import read_prompts  # noqa: E402

PROMPTS = ROOT / "offspec/data/code_edits.jsonl"


def cost_model(text: str) -> tuple[dict, dict, list]:
    """F(n) and H(rows) in seconds and the prefill seconds per prompt, from `ceiling.py`'s output."""
    lines = text.splitlines()
    f = {int(k): float(v) / 1e3 for k, v in re.findall(r"(\d+): ([\d.]+)", lines[0])}
    h = {int(k): float(v) / 1e3 for k, v in re.findall(r"(\d+): ([\d.]+)", lines[1])}
    return f, h, [float(x) for x in re.findall(r"prefill ([\d.]+) s", text)]


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


def simulate(runs, encoded, F, H, prefills, nodes=32, nowaste=False, cut=True, scfg=SuffixConfig()):
    """(speed-up over the target alone, tokens per pass) of the suffix drafter replayed on `runs`."""
    base = F[1]
    pc = PassCost(base=base, per_node=0.0, head=H[1], measured=tuple((n - 1, F[n] - base) for n in sorted(F)))
    d = SuffixDrafter(scfg, "cpu")
    t_ar = t_s = 0.0
    ntok = npass = 0
    for r, p in zip(runs, encoded):
        out = r["token_ids"]
        d.forget()
        d.reset([], p, 0)
        cfg = TreeConfig(budget=nodes, confident_budget=nodes, max_depth=nodes, drafter="suffix",
                         pass_cost=pc if cut else None)
        i, t = 0, 0.0
        while i < len(out):
            n, path = replay_pass(d, p + out[:i], out, i, cfg)
            d.observe(path, len(path))
            emitted = min(len(path), len(out) - i)
            if nowaste:
                n = len(path)
            t += interp(F, n) + interp(H, emitted) if n > 1 else F[1] + H[1]
            i += emitted
            npass += 1
        t_s += t
        t_ar += len(out) * (F[1] + H[1])
        ntok += len(out)
    prefill = sum(prefills[:len(runs)])
    return (t_ar + prefill) / (t_s + prefill), ntok / npass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ceiling", help="the output of scripts/replay/ceiling.py")
    parser.add_argument("bench", help="the offspec bench report (with an `ar` set-up) that ceiling.py read")
    parser.add_argument("--target", help="the target whose tokenizer encodes the prompts (default: the default pair's)")
    args = parser.parse_args()
    F, H, prefills = cost_model(Path(args.ceiling).read_text())
    runs = json.loads(Path(args.bench).read_text())["setups"]["ar"]["runs"]
    tok = load_tokenizer(locate_model(args.target, "target"))
    prompts = read_prompts(PROMPTS)

    def encode(prompt):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    encoded = [encode(prompts[r["prompt"]]) for r in runs]
    for label, kw in (("default", {}), ("no waste", dict(nowaste=True)), ("no cut", dict(cut=False)),
                      ("no cut no waste", dict(cut=False, nowaste=True))):
        print("%s: speed-up %.2fx, %.2f tok/pass" % ((label,) + simulate(runs, encoded, F, H, prefills, **kw)),
              flush=True)


if __name__ == "__main__":
    main()
