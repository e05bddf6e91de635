"""Running a reply off the UI thread: the generator's stream is consumed in a daemon thread and its
deltas are batched (about every 50 ms) into messages posted to the UI, which never blocks on a token.
The text is split there into the model's reasoning and its answer (offspec.util.reasoning, in the format of the
generator's `reasoning` attribute; none: all of it is the answer).

A daemon thread (not the default executor) so that quitting never waits for a long target pass.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from textual.message import Message

from offspec.types import GenerationResult, GeneratorLike, PassStats, TextDelta
from offspec.util.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning

BATCH_SECONDS = 0.05


class ReplyChunk(Message):
    """New text of reply `reply_id` (`text`: its answer, `reasoning`: its reasoning), with the statistics of the
    passes that produced it."""

    def __init__(self, reply_id: int, text: str, token_count: int, passes: tuple[PassStats, ...],
                 reasoning: str = ""):
        super().__init__()
        self.reply_id, self.text, self.token_count, self.passes = reply_id, text, token_count, passes
        self.reasoning = reasoning


class ReplyDone(Message):
    """The reply's result, and its text split: `answer` and `reasoning` (all of it the answer by default)."""

    def __init__(self, reply_id: int, result: GenerationResult, answer: Optional[str] = None, reasoning: str = ""):
        super().__init__()
        self.reply_id, self.result = reply_id, result
        self.answer = result.text if answer is None else answer
        self.reasoning = reasoning


class ReplyFailed(Message):
    def __init__(self, reply_id: int, error: BaseException):
        super().__init__()
        self.reply_id, self.error = reply_id, error


Post = Callable[[Message], object]


def _safe_post(post: Post, message: Message) -> None:
    try:
        post(message)
    except RuntimeError:  # the app's loop closed while we were generating: nobody is listening any more
        pass


class DeltaBatcher:
    """Collects deltas from the generating thread and posts them as `ReplyChunk`s at most every `interval`.

    Text never waits longer than `interval`: a timer flushes what arrived after the last post even when the
    next pass is slow. Posting happens under the lock, so chunks arrive in order and before `ReplyDone`.
    """

    def __init__(self, reply_id: int, post: Post, interval: float = BATCH_SECONDS,
                 clock: Callable[[], float] = time.monotonic, reasoning: Optional[ReasoningFormat] = None):
        self.reply_id, self._post, self.interval, self._clock = reply_id, post, interval, clock
        self._lock = threading.Lock()
        self._splitter = ReasoningSplitter(reasoning)
        self._texts: list[str] = []
        self._reasoning: list[str] = []
        self._tokens = 0
        self._passes: list[PassStats] = []
        self._last_post = float("-inf")
        self._timer: Optional[threading.Timer] = None
        self.posts = 0

    def add(self, delta: TextDelta) -> None:
        with self._lock:
            split = self._splitter.feed(delta.text)
            self._texts.append(split.answer)
            self._reasoning.append(split.reasoning)
            self._tokens += len(delta.token_ids)
            if delta.stats is not None:
                self._passes.append(delta.stats)
            wait = self.interval - (self._clock() - self._last_post)
            if wait <= 0:
                self._flush_locked()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._texts and not self._reasoning and not self._passes:
            return
        chunk = ReplyChunk(self.reply_id, "".join(self._texts), self._tokens, tuple(self._passes),
                           "".join(self._reasoning))
        self._texts, self._reasoning, self._tokens, self._passes = [], [], 0, []
        self._last_post = self._clock()
        self.posts += 1
        _safe_post(self._post, chunk)

    def finish(self, message: Message) -> None:
        """Post what is left (text the splitter held back included), then `message` (the reply's end)."""
        with self._lock:
            split = self._splitter.finish()
            if split.answer or split.reasoning:
                self._texts.append(split.answer)
                self._reasoning.append(split.reasoning)
            self._flush_locked()
            _safe_post(self._post, message)


def run_reply(generator: GeneratorLike, messages: Sequence[dict], options: dict, cancel: threading.Event,
              reply_id: int, post: Post, interval: float = BATCH_SECONDS) -> None:
    """The thread body: stream one reply, posting chunks, then `ReplyDone` or `ReplyFailed`."""
    reasoning = getattr(generator, "reasoning", None)  # a generator without one (a test's) has no reasoning split
    batcher = DeltaBatcher(reply_id, post, interval, reasoning=reasoning)
    try:
        result: Optional[GenerationResult] = None
        for event in generator.stream(list(messages), cancel=cancel, **options):
            if isinstance(event, TextDelta):
                batcher.add(event)
            elif isinstance(event, GenerationResult):
                result = event
        if result is None:
            raise RuntimeError("the generator's stream ended without a GenerationResult")
        split = split_reasoning(result.text, reasoning)
        batcher.finish(ReplyDone(reply_id, result, split.answer, split.reasoning))
    except BaseException as error:  # shown in the UI; the thread must never die silently
        batcher.finish(ReplyFailed(reply_id, error))


def start_reply(generator: GeneratorLike, messages: Sequence[dict], options: dict, cancel: threading.Event,
                reply_id: int, post: Post, interval: float = BATCH_SECONDS) -> threading.Thread:
    thread = threading.Thread(target=run_reply, name=f"offspec-reply-{reply_id}", daemon=True,
                              args=(generator, messages, options, cancel, reply_id, post, interval))
    thread.start()
    return thread
