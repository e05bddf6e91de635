"""A draft step of the default draft by nodes, this checkout's kernels against those of another checkout,
alternating in one process (the same bits, so the same work), and the kernels' share of a one-node step.

    git worktree add /tmp/before <commit>
    PYTHONPATH=. python docs/measurements/2026-11-25-draft/draft_ab.py /tmp/before/offspec/formats/csrc
"""

import collections
import hashlib
import statistics
import sys
import time
from pathlib import Path

from torch.utils.cpp_extension import load

import offspec
from offspec.formats import kernels
from offspec.profile.timing import PassTimer, timed

NODES = (1, 2, 4, 8, 16)
TYPES = {2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


def build(csrc: Path):
    flags = kernels._simd_flags()
    name = hashlib.sha256(f"{csrc.resolve()} {flags} {(csrc / 'ggml_dot512.h').read_bytes()}".encode()).hexdigest()[:10]
    directory = Path(f"/tmp/offspec-draft-ab-{name}")
    directory.mkdir(exist_ok=True)
    return load(f"ab_{name}", [str(csrc / "ggml_cpu.cpp")], extra_include_paths=[str(csrc)],
                extra_cflags=["-O3", "-ffp-contract=off", *flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(directory))


class Counting:
    """The extension, with qgemm's seconds summed by weight type."""

    def __init__(self, ext):
        self.ext, self.seconds = ext, collections.Counter()

    def __getattr__(self, name):
        return getattr(self.ext, name)

    def qgemm(self, x, w, t, cols):
        t0 = time.perf_counter()
        y = self.ext.qgemm(x, w, t, cols)
        self.seconds[TYPES.get(t, t)] += time.perf_counter() - t0
        return y


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
            for n in NODES:
                timer.draft_step(n)
                results.setdefault((name, n), []).append(
                    statistics.median(timed(lambda: timer.draft_step(n), engine.target.device) for _ in range(5)))
    for name in builds:
        print(f"{name}: draft step ms by nodes " + ", ".join(
            f"{n}: {statistics.median(results[(name, n)]) * 1e3:.1f}" for n in NODES))
    for name, ext in builds.items():
        counting = Counting(ext)
        kernels._ext = counting
        steps = 20
        t0 = time.perf_counter()
        for _ in range(steps):
            timer.draft_step(1)
        total = (time.perf_counter() - t0) / steps
        kernel = {k: v / steps for k, v in counting.seconds.items()}
        print(f"{name}: one-node step {total * 1e3:.1f} ms, kernels {sum(kernel.values()) * 1e3:.1f} ms (" +
              ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(kernel.items(), key=lambda kv: -kv[1])) + ")")


if __name__ == "__main__":
    main()
