"""How fast any drafter could go on this machine, from measured costs and the pair's own predictions.

    offspec bench --prompts offspec/data/code_edits.jsonl --n 20 --max-new-tokens 128 --budgets ar --out code-ar
    python scripts/replay/ceiling.py code-ar/bench.json [N_PROMPTS] | tee ceiling.txt

BENCH_JSON: a fresh `offspec bench` report on offspec/data/code_edits.jsonl with an `ar` set-up (its greedy tokens
are the target's output); nothing else is needed but the default pair (`offspec setup`). The output's first two
lines (the cost model) are what `suffix_replay.py` reads. In one process, on the loaded default pair:
  1. the cost model: the target's forward by tokens F(n), its LM head by rows H(r) (the walk batches rows), the
     draft's one-node step D (forward, head, top-k), each the median of 9;
  2. per output position i, teacher-forced: how many of the next tokens the draft's top-1 chain gets right
     (K_i), the rank of each next token among the draft's candidates, and the longest run of the next tokens
     found anywhere in the prompt and output so far (C_i: the ceiling of any copy drafter);
  3. per prompt, the fastest schedule of passes (dynamic programming over positions) where each pass takes an
     oracle's choice of: the target alone; a copy of the next L <= C_i tokens; a draft chain of k <= K_i tokens;
     or a copy and then a chain. The oracle proposes exactly the tokens that will be accepted (no wasted node)
     and the draft never catches up (its prompt prefill and the copied tokens cost it nothing). With `tree`, a
     chain step may also take the next token from the draft's top 4 (its rank r costs r + 1 nodes, one step).
Every simplification makes the schedule faster than any real drafter's, so its speed-up over the target alone
(both with the target's prefill, as `offspec bench` counts it) is a ceiling. docs/benchmarks.md has a run's figures.
"""

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's offspec, not an installed one

import offspec  # noqa: E402
from offspec.profile.timing import PassTimer, timed  # noqa: E402
from offspec.util.prompts import read_prompts  # noqa: E402

TOP = 4  # the widest level the tree oracle may use
PROMPTS = ROOT / "offspec/data/code_edits.jsonl"


def median_time(f, device, n=9):
    f()  # first-call allocations are not part of the time
    return statistics.median(timed(f, device) for _ in range(n))


def interp(points, x):
    """Piecewise linear through {x: seconds}, past the last point at its slope."""
    xs = sorted(points)
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    a, b = xs[-2], xs[-1]
    return points[b] + (points[b] - points[a]) * (x - b) / (b - a)


def hidden_states(runner, ids):
    """(len(ids), hidden) causal hidden states from an empty cache, in chunks of 64 (the compiled layers)."""
    runner.cache.truncate(0)
    if runner.subset_head is not None:
        runner.subset_head.admit(ids)
    out = []
    for start in range(0, len(ids), 64):
        part = ids[start:start + 64]
        q, base = len(part), start
        pos = torch.arange(base, base + q)
        visible = torch.ones((q, base + q), dtype=torch.bool)  # (q, base+q)
        visible[:, base:] = torch.ones((q, q), dtype=torch.bool).tril()
        out.append(runner.forward(torch.tensor(part), pos, pos, visible))
        runner.cache.length = base + q
    return torch.cat(out)


def copy_runs(seq, start):
    """C_i for each output position i (seq[start + i]): the longest run of the next tokens found earlier."""
    runs = []
    for i in range(start, len(seq)):
        best = 0
        for j in range(i):
            if seq[j] == seq[i]:
                k = 0
                while i + k < len(seq) and seq[j + k] == seq[i + k]:
                    k += 1
                best = max(best, k)
        runs.append(best)
    return runs


def schedule(n, F, H, D, C, ranks, tree):
    """Seconds of the fastest oracle schedule for n output tokens (see the module doc). Position i: out[i] is
    the next token; a pass there verifies nodes for out[i], out[i+1], ... and emits the accepted ones and one more."""
    best = [0.0] + [float("inf")] * n
    for i in range(n):
        options = [(1, 0, 0)]  # (tokens emitted, tree nodes, draft steps): the target alone
        for L in range(0, C[i] + 1):  # a copy of the next L tokens, then a draft chain
            if L:
                options.append((L + 1, L, 0))
            j, nodes, steps = i + L, L, 0
            while j < n and ranks[j] < (TOP if tree else 1):
                nodes, steps, j = nodes + ranks[j] + 1, steps + 1, j + 1
                options.append((j - i + 1, nodes, steps))
        for tokens, nodes, steps in options:
            end = min(n, i + tokens)
            best[end] = min(best[end], best[i] + F(1 + nodes) + H(end - i) + steps * D)
    return best[n]


def main():
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    bench = json.load(open(sys.argv[1]))
    n_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    runs = bench["setups"]["ar"]["runs"][:n_prompts]
    prompts = read_prompts(PROMPTS)
    gen = offspec.load(budget="auto")
    engine = gen.engine
    target, draft = engine.target, engine.drafter.runner
    context = gen.encode(prompts[0])
    engine.reset_to(context)
    draft.extend(context[draft.length:])
    timer = PassTimer(target, draft, 16)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    f_points = {n: median_time(lambda: PassTimer._pass(target, n), target.device) for n in sizes}
    hidden = PassTimer._pass(target, 8)
    h_points = {r: median_time(lambda: target.logits(hidden[:r]), target.device) for r in (1, 2, 4, 8)}
    D = median_time(lambda: timer.draft_step(1), draft.device)
    F, H = (lambda x: interp(f_points, x)), (lambda x: interp(h_points, x))
    print("F(n) ms:", {n: round(t * 1e3, 1) for n, t in f_points.items()})
    print("H(rows) ms:", {r: round(t * 1e3, 1) for r, t in h_points.items()})
    print(f"draft one-node step ms: {D * 1e3:.1f}", flush=True)

    total = {"ar": 0.0, "copy": 0.0, "chain": 0.0, "hybrid": 0.0, "tree": 0.0, "tokens": 0}
    for run in runs:
        prompt_ids = gen.encode(prompts[run["prompt"]])
        out = run["token_ids"]
        seq = prompt_ids + out
        target.cache.truncate(0)
        prefill = timed(lambda: target.extend(prompt_ids), target.device)
        states = hidden_states(draft, seq[:-1])[len(prompt_ids) - 1:]  # (n, hidden): predicting out[i]
        logits = draft.logits(states)  # (n, V') the draft's candidates
        ids = draft.token_ids(torch.arange(logits.shape[-1]))  # (V',) their token ids
        ranks = []
        for i, t in enumerate(out):
            hit = (ids == t).nonzero()
            ranks.append(int((logits[i] > logits[i, hit[0, 0]]).sum()) if len(hit) else 10 ** 6)
        C = copy_runs(seq, len(prompt_ids))
        n = len(out)
        times = {
            "ar": n * (F(1) + H(1)),
            "copy": schedule(n, F, H, D, C, [10 ** 6] * n, False),
            "chain": schedule(n, F, H, D, [0] * n, ranks, False),
            "hybrid": schedule(n, F, H, D, C, ranks, False),
            "tree": schedule(n, F, H, D, C, ranks, True),
        }
        for k, v in times.items():
            total[k] += prefill + v
        total["tokens"] += n
        top1 = sum(r == 0 for r in ranks) / n
        print(f"prompt {run['prompt']}: {n} tokens, prefill {prefill:.2f} s, draft top-1 {top1:.2f}; speed-up "
              + " ".join(f"{k} {(prefill + times['ar']) / (prefill + v):.2f}x" for k, v in times.items() if k != "ar"),
              flush=True)
    print("total: " + " ".join(f"{k} {total['ar'] / total[k]:.2f}x" for k in ("copy", "chain", "hybrid", "tree"))
          + f" over the target alone ({total['tokens'] / total['ar']:.2f} tok/s modelled)")


if __name__ == "__main__":
    main()
