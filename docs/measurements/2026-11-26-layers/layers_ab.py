"""Compiled decoder layers (offspec/formats/layers.py) against transformers' layers, in one process, interleaved:
the default pair's target pass by tokens, the draft step by nodes, and greedy generation on code edits.

    python docs/measurements/2026-11-26-layers/layers_ab.py [N_PROMPTS] [MAX_NEW_TOKENS]

Both paths compute the same thing (tests/test_layers.py); `runner.layers_unsupported` switches a runner's passes
between them. Times are the minimum and median of 15 runs (this 2-vCPU VM is noisy: medians move by 30%).
"""

import json
import statistics
import sys
import time

import offspec
from offspec.profile.timing import PassTimer

PATHS = {"transformers": "off (measurement)", "compiled": None}


def timings(f, n=15):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def main():
    n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    gen = offspec.load(budget="auto")
    engine = gen.engine
    draft = engine.drafter.runner
    runners = (engine.target, draft)

    def use(path):
        for r in runners:
            r.layers_unsupported = PATHS[path]

    context = gen.encode("Write a short Python function that adds two numbers, then explain it in one sentence." * 4)
    engine.reset_to(context)
    draft.extend(context[draft.length:])
    timer = PassTimer(engine.target, draft, 16)
    for what, sizes, f in (("target pass", (1, 2, 4, 8, 16), timer.target_pass), ("draft step", (1, 4, 16),
                                                                                    timer.draft_step)):
        for n in sizes:
            row = []
            for path in PATHS:
                use(path)
                mn, md = timings(lambda: f(n))
                row.append(f"{path} {mn:.1f} / {md:.1f}")
            print(f"{what} of {n}: ms min / median: {' | '.join(row)}", flush=True)

    prompts = [json.loads(line)["prompt"] for line in open("offspec/data/code_edits.jsonl")][:n_prompts]
    total = {(p, d): [0, 0.0] for p in PATHS for d in ("ar", "hybrid")}
    for i, prompt in enumerate(prompts):
        outputs = {}
        for path in PATHS:
            use(path)
            for drafter in ("ar", "hybrid"):
                engine.forget()
                t = time.perf_counter()
                if drafter == "ar":
                    result = gen.generate(prompt, max_new_tokens=max_new, speculate=False)
                else:
                    result = gen.generate(prompt, max_new_tokens=max_new, drafter="hybrid")
                total[(path, drafter)][0] += len(result.token_ids)
                total[(path, drafter)][1] += time.perf_counter() - t
                outputs[(path, drafter)] = result.token_ids
        same = outputs[("compiled", "ar")] == outputs[("compiled", "hybrid")]
        print(f"prompt {i}: compiled hybrid == compiled ar: {same}; transformers ar == compiled ar: "
              f"{outputs[('transformers', 'ar')] == outputs[('compiled', 'ar')]}", flush=True)
    for (path, drafter), (tokens, seconds) in total.items():
        print(f"{path:12s} {drafter:6s} {tokens / seconds:6.2f} tok/s ({tokens} tokens, {seconds:.1f} s)")


if __name__ == "__main__":
    main()
