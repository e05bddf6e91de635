"""One engine, many clients: a bounded queue in front of one generator, run by one worker thread.

The caches of a `Generator` are shared state, so requests run one at a time, in arrival order. A request
that finds `max_waiting` others already waiting is refused at once (`QueueFull`, with a Retry-After
estimate); the server answers 429. The worker hands each job's events to the job's asyncio event loop.
Cancelling a job (its client went away) stops its generation after the current pass, or removes it from the
queue before it starts. `shutdown()` refuses the waiting jobs and cancels the running one.

Consecutive requests share the generator's KV caches: a request that continues the previous one's
conversation reuses the cached prefix (the Generator does this by itself).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from offspec.types import GenerationResult, StreamEvent


class QueueFull(Exception):
    """Every waiting slot is taken; `retry_after` is an estimate in whole seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is stopping: the job was refused, or cancelled before it finished."""


@dataclass(eq=False)
class Job:
    """One request for the engine. `prompt` goes to `Generator.stream` as it is, unless `raw` (then it is
    text tokenized without the chat template). `options` are `Generator.stream` keywords."""

    prompt: Any
    options: dict = field(default_factory=dict)
    raw: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)  # set: stop after the current pass
    submitted_at: float = 0.0  # time.monotonic() when queued
    started_at: Optional[float] = None  # when the engine took it
    interrupted: bool = False  # cancelled by shutdown() (not by its client)
    _loop: Optional[asyncio.AbstractEventLoop] = None
    _channel: Optional[asyncio.Queue] = None  # ("event", StreamEvent) ... then ("error", exc) or ("done", None)

    @property
    def queued_seconds(self) -> float:
        return (self.started_at or time.monotonic()) - self.submitted_at


class EngineQueue:
    def __init__(self, generator, max_waiting: int = 8):
        self.generator = generator
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._running: Optional[Job] = None
        self._closed = False
        self._cond = threading.Condition()
        self._recent_seconds: deque[float] = deque(maxlen=16)  # how long recent jobs ran, for Retry-After
        self._thread = threading.Thread(target=self._work, name="offspec-engine", daemon=True)

    # --- the asyncio side --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (from the event loop thread). Raises QueueFull or ShuttingDown."""
        job._loop, job._channel = asyncio.get_running_loop(), asyncio.Queue()
        job.submitted_at = time.monotonic()
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(self._retry_after())
            self._waiting.append(job)
            self._cond.notify()

    async def events(self, job: Job) -> AsyncIterator[StreamEvent]:
        """The job's TextDeltas, then its GenerationResult; a failure is raised here (OffspecError for bad
        input, ShuttingDown when the server stopped first)."""
        while True:
            kind, value = await job._channel.get()
            if kind == "event":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def withdraw(self, job: Job) -> None:
        """The job's client is gone: drop it from the queue, or stop its generation after the current pass."""
        job.cancel.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)

    def status(self) -> dict:
        with self._cond:
            return {"running": int(self._running is not None), "waiting": len(self._waiting),
                    "max_waiting": self.max_waiting, "accepting": not self._closed}

    def shutdown(self) -> None:
        """Refuse the waiting jobs and new ones, cancel the running one (it ends after its current pass).
        Thread-safe and idempotent; it does not wait (see `close`)."""
        with self._cond:
            self._closed = True
            refused, self._waiting = list(self._waiting), deque()
            running = self._running
            if running is not None:
                running.interrupted = True
                running.cancel.set()
            self._cond.notify_all()
        for job in refused:
            self._send(job, "error", ShuttingDown("the server is shutting down; the request was not run"))
            self._send(job, "done", None)

    def close(self, timeout: Optional[float] = None) -> bool:
        """shutdown(), then wait for the worker to end; False if it is still in a pass after `timeout`."""
        self.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- the worker thread ---------------------------------------------------------------------------
    def _retry_after(self) -> int:
        """Seconds until a waiting slot is likely free: the mean recent job time times the jobs ahead."""
        mean = sum(self._recent_seconds) / len(self._recent_seconds) if self._recent_seconds else 1.0
        return max(1, math.ceil(mean * (len(self._waiting) + 1)))

    def _next_job(self) -> Optional[Job]:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if not self._waiting:
                return None  # closed
            job = self._waiting.popleft()
            self._running = job
            return job

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            job.started_at = time.monotonic()
            try:
                prompt = self.generator.tokenize(job.prompt) if job.raw else job.prompt
                for event in self.generator.stream(prompt, cancel=job.cancel, **job.options):
                    if job.interrupted and isinstance(event, GenerationResult) and event.stop_reason == "cancelled":
                        raise ShuttingDown("the server is shutting down; the generation was cancelled")
                    self._send(job, "event", event)
            except Exception as exc:  # delivered to the request, which answers it (and logs the unexpected)
                self._send(job, "error", exc)
            finally:
                with self._cond:
                    self._running = None
                    self._recent_seconds.append(time.monotonic() - job.started_at)
                self._send(job, "done", None)

    @staticmethod
    def _send(job: Job, kind: str, value: Any) -> None:
        try:
            job._loop.call_soon_threadsafe(job._channel.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            job.cancel.set()
