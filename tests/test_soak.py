"""The soak (issue 15): 300 chat turns through the API on a tiny model pair, cancelled at random points.

Each turn goes the way the chat app drives it (ChatSession over the SQLite history, `Generator.stream`
with a cancel event, partial saves, then the final save). Checks: memory after the run is within 10% of
memory after the first 30 turns (the process's RSS, and the count of live Python objects, which shows a
leak of small objects long before RSS does), and the history holds every completed turn exactly.
"""

from __future__ import annotations

import gc
import random
import threading

import psutil
import pytest

import offspec
from tui.history import HistoryStore
from tui.session import ChatSession

pytestmark = pytest.mark.slow  # 300 chat turns (minutes)

TURNS, BASELINE_AT, TURNS_PER_CHAT = 300, 30, 4
WORDS = ("cache", "tree", "draft", "target", "token", "layer", "budget", "pass", "sort", "graph")


def memory() -> tuple[int, int]:
    gc.collect()
    return psutil.Process().memory_info().rss, len(gc.get_objects())


def test_300_turns_with_random_cancels_keep_memory_flat_and_every_turn_saved(tiny_dirs, tmp_path):
    target, draft = tiny_dirs[("llama", 1)]
    gen = offspec.load(str(target), str(draft), max_context=512)  # budget auto: the adaptive policy runs too
    session = ChatSession(HistoryStore.open(tmp_path))
    rng = random.Random(15)
    expected: list[tuple[int, str, str, str]] = []  # (chat id, user text, reply text, status) of every turn
    cancelled = 0
    baseline = None
    for turn in range(TURNS):
        if turn % TURNS_PER_CHAT == 0:
            session.new_chat()
        text = f"turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        user, reply = session.start_turn(text)
        cancel = threading.Event()
        cancel_at = rng.choice([None, None, 0, 1, 2, 3, 5])  # cancel after this many passes (None: never)
        if cancel_at == 0:
            cancel.set()  # before the first pass
        result, passes = None, 0
        for event in gen.stream(session.engine_messages(), max_new_tokens=rng.randint(4, 16),
                                temperature=rng.choice([0.0, 0.8]), seed=turn, cancel=cancel):
            if isinstance(event, offspec.GenerationResult):
                result = event
            elif event.stats is not None:
                passes += 1
                if passes % 2 == 0:
                    session.save_partial(reply.id, "partial")  # what the app does while a reply grows
                if cancel_at is not None and passes >= cancel_at:
                    cancel.set()
        assert result is not None
        status = session.finish_reply(reply.id, result.text, stop_reason=result.stop_reason)
        cancelled += result.stop_reason == "cancelled"
        expected.append((session.chat.id, text, result.text, status))
        if turn + 1 == BASELINE_AT:
            baseline = memory()
    rss, objects = memory()
    assert cancelled >= TURNS // 5  # the random cancels did happen, at every point of a reply
    assert rss <= baseline[0] * 1.10, f"RSS grew from {baseline[0] / 2**20:.0f} MB to {rss / 2**20:.0f} MB"
    assert objects <= baseline[1] * 1.10, f"live objects grew from {baseline[1]} to {objects}"
    assert session.unsaved == {} and not session.failing

    # the history, as a restart would read it, holds every turn exactly
    session.store.close()
    store = HistoryStore.open(tmp_path)
    saved = []
    for chat in sorted(store.list_chats(), key=lambda c: c.id):
        messages = store.messages(chat.id)
        assert [m.role for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        saved += [(chat.id, u.content, a.content, a.status) for u, a in zip(messages[::2], messages[1::2])]
    assert saved == expected
    assert {status for *_, status in saved} <= {"done", "cancelled"}
