"""A whole pass of the default target by tokens, this checkout's kernels against those of another checkout,
alternating in one process (the same bits, so the same work).

    git worktree add /tmp/before 43b7635
    PYTHONPATH=. python docs/measurements/2026-11-25-kw/pass_ab.py /tmp/before/offspec/formats/csrc
"""

import hashlib
import statistics
import sys
from pathlib import Path

from torch.utils.cpp_extension import load

import offspec
from offspec.formats import kernels
from offspec.profile.timing import PassTimer, timed

TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def build(csrc: Path):
    flags = kernels._simd_flags()
    name = hashlib.sha256(f"{csrc.resolve()} {flags}".encode()).hexdigest()[:10]
    directory = Path(f"/tmp/offspec-pass-ab-{name}")
    directory.mkdir(exist_ok=True)
    return load(f"ab_{name}", [str(csrc / "ggml_cpu.cpp")], extra_include_paths=[str(csrc)],
                extra_cflags=["-O3", "-ffp-contract=off", *flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(directory))


def main():
    builds = {"before": build(Path(sys.argv[1])), "this": build(kernels.CSRC)}
    gen = offspec.load(budget=8)
    engine = gen.engine
    context = gen.encode("Write a short Python function that adds two numbers, then explain it in one sentence." * 4)
    engine.reset_to(context)
    draft = engine.drafter.runner
    draft.extend(context[draft.length:])
    timer = PassTimer(engine.target, draft, 8)
    results = {}
    for _ in range(5):
        for name, ext in builds.items():
            kernels._ext = ext  # what kernels.linear calls
            for n in TOKENS:
                timer.target_pass(n)
                results.setdefault((name, n), []).append(
                    statistics.median(timed(lambda: timer.target_pass(n), engine.target.device) for _ in range(3)))
    for name in builds:
        print(f"{name}: ms by tokens " + ", ".join(f"{n}: {statistics.median(results[(name, n)]) * 1e3:.1f}"
                                                  for n in TOKENS))


if __name__ == "__main__":
    main()
