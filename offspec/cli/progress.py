"""How the command line shows ProgressEvents on stderr.

On a terminal: a tqdm bar for each step with a known total, a start line and a `done` line for the others.
Anywhere else (a log file, a pipe, CI): plain lines, never `\\r`-joined bars: one when a step starts, at most
one every `interval` seconds while it runs, and one when it ends.

Use it as a context manager: bars still open when the command ends (an error, Ctrl-C) are closed on the way
out, so nothing is drawn after the `error:` or `interrupted` line.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

from offspec.progress import ProgressEvent

PLAIN_INTERVAL = 10.0  # seconds between two lines of a running step when stderr is not a terminal
BYTE_TOTAL = 10_000  # a total above this is taken to count bytes (shown as KB/MB/GB)


def _amount(done: float, total: Optional[float]) -> str:
    if total is None:
        return f"{done:,.0f}" if done else ""
    if total > BYTE_TOTAL:
        from tqdm import tqdm

        size = tqdm.format_sizeof
        return f"{100 * done / total:.0f}% ({size(done)}B of {size(total)}B)" if total else ""
    return f"{100 * done / total:.0f}% ({done:,.0f}/{total:,.0f})" if total else ""


class TqdmProgress:
    """A ProgressFn for the CLI (see the module doc). `enabled=False` shows nothing."""

    def __init__(self, enabled: bool = True, *, stream: Optional[TextIO] = None, tty: Optional[bool] = None,
                 interval: float = PLAIN_INTERVAL, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self._stream = stream
        self._tty = tty
        self.interval, self._clock = interval, clock
        self.bars: dict[str, object] = {}  # terminal: the open tqdm bar of each step
        self.started: dict[str, float] = {}  # when each running step began
        self._last_line: dict[str, float] = {}  # plain: when each running step last printed
        self._lock = threading.Lock()  # events may come from loader threads

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr  # read late: tests swap sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> "TqdmProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the bars still open (their last state stays on screen); later events start afresh."""
        with self._lock:
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()
            self.started.clear()
            self._last_line.clear()

    def __call__(self, event: ProgressEvent) -> None:
        if not self.enabled:
            return
        with self._lock:
            if event.total is None and event.step not in self.bars or not self.tty:
                self._plain(event)
            else:
                self._bar(event)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _plain(self, event: ProgressEvent) -> None:
        now = self._clock()
        if event.step not in self.started:
            self.started[event.step] = self._last_line[event.step] = now
            self._print(f"{event.message} ...")
        elif event.finished:
            pass
        elif now - self._last_line[event.step] >= self.interval and event.total is not None:
            self._last_line[event.step] = now
            self._print(f"{event.message}: {_amount(event.done, event.total)}")
        if event.finished:
            elapsed = now - self.started.pop(event.step)
            self._last_line.pop(event.step, None)
            self._print(f"{event.message}: done in {elapsed:.1f} s")

    def _bar(self, event: ProgressEvent) -> None:
        from tqdm import tqdm

        bar = self.bars.get(event.step)
        if bar is None:
            big = bool(event.total and event.total > BYTE_TOTAL)
            bar = tqdm(total=event.total, desc=event.message, unit="B" if big else "it", unit_scale=big,
                       file=self.stream, leave=True, dynamic_ncols=True)
            self.bars[event.step] = bar
        bar.set_description(event.message, refresh=False)
        if event.total is not None and bar.total != event.total:
            bar.total = event.total
        bar.n = event.done
        bar.refresh()
        if event.finished:
            bar.close()
            del self.bars[event.step]
