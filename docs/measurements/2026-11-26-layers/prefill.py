"""A 150-token prefill of the default pair's target and draft, transformers' layers against compiled ones, two rounds.

    python docs/measurements/2026-11-26-layers/prefill.py
"""
import offspec, time, torch
gen = offspec.load(budget=8)
for runner in (gen.engine.target, gen.engine.drafter.runner):
    toks = gen.encode("Write a short Python function that adds two numbers, then explain it in one sentence. " * 10)[:150]
    for rep in range(2):
        for path in ("off", None):
            runner.layers_unsupported = path
            runner.cache.truncate(0)
            t = time.perf_counter(); runner.extend(toks, chunk=len(toks) if runner.exact else 48); dt = time.perf_counter() - t
            print("target" if runner.exact else "draft", "transformers" if path else "compiled", f"{dt:.2f} s for {len(toks)} tokens", flush=True)
