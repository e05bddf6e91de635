"""Run an `offspec` command and signal it at a chosen progress event (for tests/test_faults.py).

    python tests/helpers/fault_harness.py STEP[:N] SIGNAL offspec-args...

sends SIGNAL (INT or KILL) to this process at the N-th (default 1st) ProgressEvent whose step is STEP, as
the command line renders it: the same point of the load every run, with no timing guesswork (STEP `reply`:
the N-th event of a reply stream, inside the decode loop). It prints `harness: signalled at ...` on stderr
first. Used by tests/test_faults.py.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout first

import offspec  # noqa: E402,F401  (first: sets the OpenMP wait policy before torch, like main.py)
from offspec.cli import progress as cli_progress  # noqa: E402
from offspec.cli.main import main  # noqa: E402


def arm_reply(nth: int, sig: signal.Signals) -> None:
    """Signal at the N-th event a reply stream yields (the decode loop itself)."""
    from offspec.generator import Generator

    stream = Generator.stream

    def wrapped(self, *args, **kwargs):
        for i, event in enumerate(stream(self, *args, **kwargs), start=1):
            if i == nth:
                print(f"harness: signalled at reply event {i}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), sig)
            yield event

    Generator.stream = wrapped


def arm(step: str, nth: int, sig: signal.Signals) -> None:
    if step == "reply":
        return arm_reply(nth, sig)
    seen = {"count": 0}
    render = cli_progress.TqdmProgress.__call__

    def call(self, event):
        if event.step == step:
            seen["count"] += 1
            if seen["count"] == nth:
                print(f'harness: signalled at {step} "{event.message}"', file=sys.stderr, flush=True)
                os.kill(os.getpid(), sig)
        return render(self, event)

    cli_progress.TqdmProgress.__call__ = call


if __name__ == "__main__":
    where, name, *argv = sys.argv[1:]
    step, _, nth = where.partition(":")
    arm(step, int(nth or 1), signal.Signals[f"SIG{name}"])
    sys.exit(main(argv))
