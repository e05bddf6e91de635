"""Seconds of one pass of the default pair's resident target by tokens in the pass (and of a draft step by nodes),
AVX-512 against AMX in one process (the kernels' `set_amx`; the same bits).

    PYTHONPATH=. python docs/measurements/2026-11-25-amx/pass_tokens.py
"""

import statistics

import offspec
from offspec.formats import kernels
from offspec.profile.timing import PassTimer, timed


def main():
    gen = offspec.load(budget=8)
    engine = gen.engine
    context = gen.encode("Write a short Python function that adds two numbers, then explain it in one sentence." * 4)
    engine.reset_to(context)
    draft = engine.drafter.runner
    draft.extend(context[draft.length :])
    timer = PassTimer(engine.target, draft, 8)
    ext = kernels.compiled()
    for amx in (False, True):
        ext.set_amx(amx)
        row = []
        for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64):
            timer.target_pass(n)
            seconds = statistics.median(timed(lambda: timer.target_pass(n), engine.target.device) for _ in range(5))
            row.append(f"{n}: {seconds * 1e3:.0f}")
        steps = []
        for k in (1, 4, 8, 16):
            timer.draft_step(k)
            seconds = statistics.median(timed(lambda: timer.draft_step(k), draft.device) for _ in range(5))
            steps.append(f"{k}: {seconds * 1e3:.1f}")
        print(f"{'AMX' if amx else 'AVX-512'}: target pass ms by tokens {', '.join(row)}; "
              f"draft step ms by nodes {', '.join(steps)}")


if __name__ == "__main__":
    main()
