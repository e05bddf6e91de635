"""Loading the models off the UI thread, relaying ProgressEvents to the loading screen as messages."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from textual.message import Message

from offspec.progress import ProgressEvent, ProgressFn
from offspec.types import GeneratorLike

GeneratorFactory = Callable[[ProgressFn], GeneratorLike]
Post = Callable[[Message], object]
RELAY_SECONDS = 0.05


class LoadProgress(Message):
    def __init__(self, event: ProgressEvent):
        super().__init__()
        self.event = event


class LoadDone(Message):
    def __init__(self, generator: GeneratorLike):
        super().__init__()
        self.generator = generator


class LoadFailed(Message):
    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error


class ProgressRelay:
    """A ProgressFn that posts events to the UI, at most one per `interval` for a running step.

    Byte-level progress can come thousands of times a second; the UI only needs the latest state. A new
    step, a finished step or a step's first event is always posted; a skipped event is posted before the
    next one that passes, so no step's final state is lost.
    """

    def __init__(self, post: Post, interval: float = RELAY_SECONDS, clock: Callable[[], float] = time.monotonic):
        self._post, self.interval, self._clock = post, interval, clock
        self._lock = threading.Lock()
        self._pending: Optional[ProgressEvent] = None
        self._last_step: Optional[str] = None
        self._last_post = float("-inf")

    def __call__(self, event: ProgressEvent) -> None:
        with self._lock:
            urgent = event.finished or event.step != self._last_step
            if not urgent and self._clock() - self._last_post < self.interval:
                self._pending = event
                return
            if self._pending is not None and self._pending.step != event.step:
                self._send(self._pending)
            self._pending = None
            self._send(event)

    def flush(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._send(self._pending)
                self._pending = None

    def _send(self, event: ProgressEvent) -> None:
        self._last_step, self._last_post = event.step, self._clock()
        try:
            self._post(LoadProgress(event))
        except RuntimeError:  # the app is gone
            pass


def run_load(factory: GeneratorFactory, post: Post) -> None:
    """The thread body: build the generator, posting progress, then `LoadDone` or `LoadFailed`."""
    relay = ProgressRelay(post)
    try:
        generator = factory(relay)
        message: Message = LoadDone(generator)
    except BaseException as error:  # every failure is shown on the loading screen
        message = LoadFailed(error)
    relay.flush()
    try:
        post(message)
    except RuntimeError:
        pass


def start_load(factory: GeneratorFactory, post: Post) -> threading.Thread:
    """A daemon thread, so that quitting during a long load does not wait for it."""
    thread = threading.Thread(target=run_load, args=(factory, post), name="offspec-load", daemon=True)
    thread.start()
    return thread
