"""CPU threads on a shared machine: no spin-waiting, and no more threads than the cores left free.

A CPU decode runs thousands of short parallel regions per second. Two things make it collapse when another
process keeps a core busy (issue 15: a draft step went 12x slower beside one CPU-heavy process on 2 cores):

1. OpenMP threads that finish their share spin, waiting for the one that shares its core with the other
   process. `openmp_env_defaults()` sets a passive wait policy (`OMP_WAIT_POLICY=PASSIVE` for GNU OpenMP,
   which torch's CPU build and its MKL use, `KMP_BLOCKTIME=0` for Intel's) unless the user set one, with a
   short spin before sleeping (`GOMP_SPINCOUNT=20000`, about 0.2 ms): a one-token pass runs hundreds of
   kernels a few tens of microseconds apart, and waking sleeping threads for each cost 10-15% of its time
   (paired runs of the target alone, 2-core VM), while 0.2 ms is too short to starve another process. It must
   run before torch starts its thread pool: `offspec/__init__.py` runs it first thing, so `import offspec`
   before `import torch` is enough (`openmp_env_applied()` says whether it came in time).
2. More threads than free cores: a parallel region ends only when its slowest thread does, and a thread that
   shares a core waits for time slices. `ThreadGovernor` measures how much CPU other processes use (the
   machine's busy time minus this process's own), and sets torch's thread count to the cores they leave
   free: at load, and again between passes every `interval` seconds.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

# Set before torch loads its OpenMP runtime, unless the user chose otherwise.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
PASSIVE_SPIN = {"GOMP_SPINCOUNT": "20000"}  # with the passive policy only: it would cut a user's ACTIVE short
_applied: Optional[bool] = None


def openmp_env_defaults() -> bool:
    """Set `OPENMP_ENV` for values the user did not set. True when torch was not imported yet (it takes
    effect); the first call's answer is kept."""
    global _applied
    if _applied is None:
        _applied = "torch" not in sys.modules
        if _applied:
            if "OMP_WAIT_POLICY" not in os.environ:
                for name, value in PASSIVE_SPIN.items():
                    os.environ.setdefault(name, value)
            for name, value in OPENMP_ENV.items():
                os.environ.setdefault(name, value)
    return _applied


def openmp_env_applied() -> bool:
    """Whether the passive wait policy came before torch's thread pool (False: torch was imported first)."""
    return bool(_applied)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, e.g. under taskset), else all of them."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


_initial_threads: Optional[int] = None


def initial_threads() -> int:
    """torch's thread count before offspec changed it (OMP_NUM_THREADS or the core count): the most used."""
    global _initial_threads
    if _initial_threads is None:
        import torch

        _initial_threads = torch.get_num_threads()
    return _initial_threads


@dataclass
class CpuSample:
    wall: float  # seconds (monotonic clock)
    busy: float  # CPU seconds spent on the allowed CPUs by everything, this process included
    own: float  # CPU seconds spent by this process


def read_cpu(cpus: Sequence[int]) -> CpuSample:
    import psutil

    per_cpu = psutil.cpu_times(percpu=True)
    busy = 0.0
    for i in cpus:
        if i < len(per_cpu):
            t = per_cpu[i]
            busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)  # steal counts as busy: not ours to use
    own = psutil.Process().cpu_times()
    # A child's time is ours too: the first load compiles offspec's kernels in a child (about 40 s of g++ on 2
    # cores), which counted as another process's and left the warm-up, the budget plan and `offspec profile`'s
    # measurements on one thread.
    return CpuSample(time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system)


@dataclass
class ThreadGovernor:
    """Keeps torch's thread count at the cores other processes leave free (within [1, max_threads]).

    `update()` between passes: at most every `interval` seconds it samples the CPU times and, when the
    smoothed load of the other processes calls for another count, sets it and returns True. In between it reads
    only `clock`: a sample reads /proc (70 us in a loop, more between two passes that stream the weights)."""

    max_threads: int
    cpus: list[int] = field(default_factory=allowed_cpus)
    interval: float = 2.0  # seconds between samples
    smoothing: float = 0.5  # weight of the newest sample in the running estimate of the others' load
    read: Callable[[Sequence[int]], CpuSample] = read_cpu
    clock: Callable[[], float] = time.monotonic  # the clock of `read`'s wall times
    set_threads: Optional[Callable[[int], None]] = None  # default: torch.set_num_threads
    get_threads: Optional[Callable[[], int]] = None  # default: torch.get_num_threads
    others: Optional[float] = None  # cores busy with other processes (smoothed); None before the first sample
    changes: list[dict] = field(default_factory=list)  # (at, others, threads) of every change, for reports

    def __post_init__(self) -> None:
        import torch

        self.set_threads = self.set_threads or torch.set_num_threads
        self.get_threads = self.get_threads or torch.get_num_threads
        self.max_threads = max(1, min(self.max_threads, len(self.cpus)))
        self._last = self.read(self.cpus)

    @property
    def threads(self) -> int:
        return self.get_threads()

    def wanted(self) -> int:
        """The thread count for the current estimate of the others' load."""
        if self.others is None:
            return self.max_threads
        free = len(self.cpus) - self.others
        return max(1, min(self.max_threads, int(free + 0.5)))

    def update(self, force: bool = False) -> bool:
        """Sample (when `interval` has passed, or `force`) and set the thread count; True when it changed."""
        if not force and self.clock() - self._last.wall < self.interval:
            return False  # not due: no sample
        now = self.read(self.cpus)
        wall = now.wall - self._last.wall
        if wall <= 0 or (not force and wall < self.interval):
            return False
        others = max(0.0, min(float(len(self.cpus)), ((now.busy - self._last.busy) - (now.own - self._last.own)) / wall))
        self._last = now
        self.others = others if self.others is None else self.smoothing * others + (1 - self.smoothing) * self.others
        want = self.wanted()
        if want == self.threads:
            return False
        self.set_threads(want)
        self.changes.append({"others": round(self.others, 2), "threads": want})
        return True

    def summary(self) -> dict:
        return {"threads": self.threads, "max_threads": self.max_threads, "cpus": len(self.cpus),
                "others_busy_cores": round(self.others, 2) if self.others is not None else None,
                "changes": self.changes[-10:], "passive_wait": openmp_env_applied()}


def configure_threads(threads: Optional[int]) -> Optional[ThreadGovernor]:
    """For a CPU load: `threads` fixed (set now, no governor) or None (a governor that starts sampling now)."""
    import torch

    base = initial_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        return None
    return ThreadGovernor(max_threads=base)
