"""The chat's parts without a UI: history store, settings parsing, tree rendering, batching, status figures."""

from __future__ import annotations

import random
import sqlite3
import threading
import time

import pytest

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent
from offspec.types import GenerationResult, ModelInfo, PassStats, TextDelta, TreeSnapshot
from tui.export import chat_markdown, export_chat
from tui.fake import FakePassStats
from tui.history import MIGRATIONS, SCHEMA_VERSION, HistoryDamaged, HistoryStore
from tui.loader import LoadProgress, ProgressRelay
from tui.session import ChatSession, title_from
from tui.settings import ChatSettings, parse_budget, parse_settings
from tui.stats import ReplyMeter, budget_label, speed_line
from tui.streaming import DeltaBatcher, ReplyChunk, ReplyDone, run_reply
from tui.tree_view import TokenLabels, TreeShape, depth_counts, render_tree

INFO = ModelInfo("t", "d", "cuda:0", "bfloat16", 4096, 64, extra={"budget_source": "profile"})


# -- history ---------------------------------------------------------------------------------


def test_history_round_trip_and_schema_version(tmp_path):
    store = HistoryStore.open(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION
    chat = store.create_chat("Title", "sys")
    m = store.add_message(chat.id, "user", "hi")
    store.add_message(chat.id, "assistant", "hello", stats={"tokens": 1})
    store.update_message(m.id, "hi!", status="done")
    store.set_setting("k", "v")
    store.close()
    store = HistoryStore.open(tmp_path)
    assert [(x.role, x.content, x.stats) for x in store.messages(chat.id)] == [
        ("user", "hi!", {}), ("assistant", "hello", {"tokens": 1})]
    assert store.get_setting("k") == "v" and store.list_chats()[0].system_prompt == "sys"
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.delete_chat(chat.id)
    assert store.messages(chat.id) == []  # cascades


def test_history_upgrades_a_version_1_database(tmp_path):
    path = tmp_path / "history.sqlite3"
    with sqlite3.connect(path) as db:  # what the first release wrote
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version VALUES (1)")
        for statement in MIGRATIONS[1]:
            db.execute(statement)
        db.execute("INSERT INTO chats VALUES (1, 'old', '', 1.0, 1.0)")
        db.execute("INSERT INTO messages (chat_id, role, content, status, created_at) VALUES (1, 'user', 'hey', 'done', 1.0)")
    store = HistoryStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    [message] = store.messages(1)
    assert (message.content, message.stats) == ("hey", {})
    store.set_setting("a", "b")  # the table version 2 added


def test_history_refuses_newer_and_corrupt_databases(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version VALUES (99)")
    with pytest.raises(OffspecError, match="newer offspec"):
        HistoryStore(newer)
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryDamaged, match="is damaged"):  # HistoryStore.open sets such a file aside
        HistoryStore(corrupt)


def test_reply_left_streaming_by_a_crash_is_marked_interrupted(tmp_path):
    session = ChatSession(HistoryStore.open(tmp_path))
    session.add_user_message("q")
    reply = session.begin_reply()
    session.save_partial(reply.id, "half an ans")
    # no finish: the process "crashed" here
    store = HistoryStore.open(tmp_path)
    assert [(m.content, m.status) for m in store.messages(session.chat.id)][-1] == ("half an ans", "interrupted")


def test_session_messages_and_titles(tmp_path):
    session = ChatSession(HistoryStore.open(tmp_path))
    session.update_settings(ChatSettings(system_prompt="S"))
    session.add_user_message("  \nFirst line of a long question that goes on and on and on\nmore")
    reply = session.begin_reply()
    assert session.engine_messages()[-1]["role"] == "user"  # the empty reply is not sent
    assert session.finish_reply(reply.id, "A", stop_reason="cancelled") == "cancelled"
    assert session.engine_messages()[0] == {"role": "system", "content": "S"}
    assert session.engine_messages()[-1] == {"role": "assistant", "content": "A"}
    assert session.title.startswith("First line") and len(session.title) <= 48
    assert title_from("") == "New chat"
    assert ChatSession(HistoryStore.open(tmp_path)).settings.system_prompt == "S"  # settings persist


# -- settings --------------------------------------------------------------------------------


def test_settings_parse_and_one_line_errors():
    base = ChatSettings()
    s = parse_settings(base, temperature="0", top_p="1", budget="AUTO", max_new_tokens="8", system_prompt=" x ")
    assert (s.temperature, s.top_p, s.budget, s.max_new_tokens, s.system_prompt) == (0.0, 1.0, None, 8, "x")
    assert parse_budget("128") == 128
    cases = {
        "budget": ("abc", "budget must be 'auto' or a positive whole number"),
        "temperature": ("warm", "temperature must be a number"),
        "top_p": ("1.5", "top_p must be in (0, 1]"),
        "max_new_tokens": ("0", "max_new_tokens must be a positive whole number"),
    }
    for field, (value, message) in cases.items():
        form = dict(temperature="0.7", top_p="0.9", budget="auto", max_new_tokens="10", system_prompt="")
        form[field] = value
        with pytest.raises(OffspecError) as info:
            parse_settings(base, **form)
        assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(OffspecError):
        parse_budget("-3")
    assert ChatSettings.from_json('{"temperature": -1}') == ChatSettings()  # invalid saved value -> defaults
    assert ChatSettings.from_json('{"top_p": 0.5, "future_key": 1}').top_p == 0.5


# -- tree rendering --------------------------------------------------------------------------


def test_tree_rendering_highlights_the_accepted_path():
    # root -> a(1) -> b(3) ; rejected: c(2) under root, d(4) under a, e(5) under b
    tree = TreeSnapshot(tokens=(0, 1, 2, 3, 4, 5), parents=(-1, 0, 0, 1, 1, 3), accepted=(0, 1, 3), bonus_token=9)
    text = render_tree(tree, decode=lambda ids: "abcdefghij"[ids[0]])
    plain = text.plain
    assert "5 drafted · 2 accepted + bonus · depth 3" in plain
    assert "accepted: 'b' 'd' ⇒ 'j' (target)" in plain
    green = {plain[span.start:span.end] for span in text.spans if span.style == "bold green"}
    assert {"'b'", "'d'"} <= {g.strip() for g in green}
    assert "'c'·1" in plain  # the rejected sibling at depth 1 with its subtree size


def test_tree_rendering_stays_small_for_thousands_of_nodes():
    rng = random.Random(0)
    n = 3000
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
    path, node = [0], 0
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    while node in children and len(path) < 6:
        node = children[node][0]
        path.append(node)
    tree = TreeSnapshot(tuple(rng.randrange(500) for _ in range(n)), tuple(parents), tuple(path), 7)
    started = time.perf_counter()
    plain = render_tree(tree).plain
    assert time.perf_counter() - started < 1.0
    lines = plain.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) < 60
    assert sum(depth_counts(TreeShape.of(tree))) == n - 1
    assert "#" in plain  # no decoder: token ids


def test_token_labels_survive_bad_decoders_and_odd_text():
    def decode(ids):
        if ids[0] == 13:
            raise ValueError("no such token")
        return "\n" if ids[0] == 1 else "a-very-long-token"

    labels = TokenLabels(decode)
    assert labels(13) == "#13" and labels(1) == "'\\n'" and len(labels(2)) <= 10
    assert render_tree(None).plain.startswith("No speculation tree yet")
    malformed = TreeSnapshot(tokens=(1, 2), parents=(-1, 7), accepted=(0, 5), bonus_token=3)
    assert "accepted" in render_tree(malformed).plain


# -- streaming and progress ------------------------------------------------------------------


def _delta(text: str) -> TextDelta:
    return TextDelta(text, (1,), PassStats(tree_size=3, accepted=0, emitted=1, draft_seconds=0.0,
                                           target_seconds=0.01, budget=8))


def test_batcher_coalesces_fast_deltas_and_flushes_the_tail_on_a_timer():
    posted = []
    batcher = DeltaBatcher(1, posted.append, interval=0.05)
    for i in range(100):
        batcher.add(_delta(str(i % 10)))
    assert len(posted) == 1  # the first delta goes at once, the rest wait for the timer
    deadline = time.monotonic() + 5
    while len(posted) < 2 and time.monotonic() < deadline:  # the tail arrives without another delta
        time.sleep(0.01)
    assert "".join(c.text for c in posted) == "0123456789" * 10
    assert sum(c.token_count for c in posted) == 100 and sum(len(c.passes) for c in posted) == 100


def test_run_reply_posts_chunks_then_done_and_failures():
    class Gen:
        def stream(self, prompt, cancel=None, **kw):
            yield _delta("a")
            yield _delta("b")
            yield GenerationResult("ab", [1, 1], [], 0.1, "eos")

    posted = []
    run_reply(Gen(), [{"role": "user", "content": "x"}], {}, threading.Event(), 7, posted.append)
    assert isinstance(posted[-1], ReplyDone) and posted[-1].reply_id == 7
    assert "".join(m.text for m in posted if isinstance(m, ReplyChunk)) == "ab"

    class Broken:
        def stream(self, prompt, cancel=None, **kw):
            yield _delta("a")

    posted.clear()
    run_reply(Broken(), [], {}, threading.Event(), 8, posted.append)
    assert "without a GenerationResult" in str(posted[-1].error)


def test_progress_relay_throttles_but_keeps_step_ends():
    posted = []
    now = [0.0]
    relay = ProgressRelay(posted.append, interval=0.05, clock=lambda: now[0])
    for i in range(1000):
        relay(ProgressEvent("load", "bytes", done=i, total=1000))
    relay(ProgressEvent("convert", "converting", done=1, total=2))  # a new step: load's last state first
    events = [m.event for m in posted if isinstance(m, LoadProgress)]
    assert [e.step for e in events] == ["load", "load", "convert"]
    assert events[1].done == 999
    relay(ProgressEvent("convert", "converting", done=2, total=2, finished=True))
    assert posted[-1].event.finished


# -- status line and export ------------------------------------------------------------------


def test_speed_line_splits_weight_waiting_from_compute():
    meter = ReplyMeter(started=time.monotonic())
    stats = FakePassStats(tree_size=10, accepted=3, emitted=4, draft_seconds=0.01, target_seconds=0.2, budget=64,
                          io_wait_seconds=0.15, bytes_streamed=3_000_000_000)
    meter.add(8, (stats, stats))
    line = speed_line(meter, INFO, None)
    assert "4.00 tok/pass" in line and "budget 64 (profile)" in line
    assert "target 200 ms/pass: 150 ms weights + 50 ms compute" in line and "20.00 GB/s" in line
    assert "while loading" not in line  # no pass grew its tree
    grown = FakePassStats(tree_size=26, accepted=3, emitted=4, draft_seconds=0.01, target_seconds=0.2, budget=16,
                          io_wait_seconds=0.15, bytes_streamed=3_000_000_000, grown_nodes=10)
    meter.add(4, (grown,))
    assert "+3 nodes/pass while loading" in speed_line(meter, INFO, None)  # 10 nodes over 3 passes
    assert "experts" not in speed_line(meter, INFO, None)  # no mixture
    routed = PassStats(tree_size=1, accepted=1, emitted=2, draft_seconds=0, target_seconds=0.1, budget=4,
                       io_wait_seconds=0.05, bytes_streamed=10**8, experts_routed=300, expert_hits=240)
    meter.add(2, (routed,))  # a mixture's experts read as routed: 300 over 4 passes, 60 of them read
    assert "75 experts/pass, 15 read (80% cached)" in speed_line(meter, INFO, None)
    plain = PassStats(tree_size=1, accepted=1, emitted=2, draft_seconds=0, target_seconds=0.1, budget=4)
    meter2 = ReplyMeter()
    meter2.add(2, (plain,))
    assert "target 100 ms/pass" in speed_line(meter2, INFO, 4) and "weights" not in speed_line(meter2, INFO, 4)
    assert budget_label(INFO, 16) == "budget 16 (fixed)"
    assert budget_label(INFO, None, 0) == "target alone (profile)"  # auto predicted no tree pays off
    gated = ModelInfo("t", "d", "cpu", "float32", 4096, 3,
                      extra={"budget_source": "estimate", "budget_adaptive": {"gated_suffix": True}})
    assert budget_label(gated, None, 32) == "suffix drafts where they pay (estimate)"
    assert budget_label(gated, 8) == "budget 8 (fixed)"
    assert speed_line(None, INFO, None) == "ready · budget 64 (profile)"
    started = ReplyMeter(started=time.monotonic() - 3.2)  # a reply whose prompt is still being read
    assert speed_line(started, INFO, None) == "waiting for the first token · 3 s · budget 64 (profile)"
    started.finish(GenerationResult("", [], [], 3.5, "cancelled"))  # stopped before its first token
    assert speed_line(started, INFO, None) == "ready · budget 64 (profile)"
    meter.finish(GenerationResult("x", [1] * 8, [stats, stats], 2.0, "cancelled"))
    assert "4.0 tok/s" in speed_line(meter, INFO, None) and "cancelled" in speed_line(meter, INFO, None)
    assert "prompt" not in speed_line(meter, INFO, None)  # no prompt token prefilled: no prompt time shown
    meter.finish(GenerationResult("x", [1] * 8, [stats, stats], 2.0, "eos", prompt_tokens=40, prefill_seconds=0.5))
    assert "prompt 0.50 s" in speed_line(meter, INFO, None)
    cached = GenerationResult("x", [1] * 8, [stats], 2.0, "eos", prompt_tokens=40, reused_prompt_tokens=39,
                              prefill_seconds=1e-5)
    meter.finish(cached)
    assert "prompt" not in speed_line(meter, INFO, None)  # all cached but the last token: nothing waited for


def test_export_writes_markdown_without_overwriting(tmp_path):
    store = HistoryStore.open(tmp_path)
    session = ChatSession(store)
    session.add_user_message("Q?")
    reply = session.begin_reply()
    session.finish_reply(reply.id, "A.", stop_reason="cancelled")
    first = export_chat(tmp_path, session.chat.id, session.title, "sys", session.messages, INFO)
    second = export_chat(tmp_path, session.chat.id, session.title, "sys", session.messages, INFO)
    assert first != second and first.parent == tmp_path / "exports"
    text = first.read_text()
    assert text.startswith("# Q?") and "## System\n\nsys" in text and "## Assistant (cancelled)\n\nA." in text
    assert "`t`" in chat_markdown("T", "", [], INFO)


def test_resources_report_cuda_memory_through_the_loaded_torch(monkeypatch):
    from types import SimpleNamespace

    from tui.stats import GIB, ResourceSampler

    cuda = SimpleNamespace(is_available=lambda: True, current_device=lambda: 0,
                           memory_allocated=lambda i: 3 * GIB, memory_reserved=lambda i: 4 * GIB,
                           get_device_properties=lambda i: SimpleNamespace(total_memory=80 * GIB))
    fake_torch = SimpleNamespace(cuda=cuda, device=lambda name: SimpleNamespace(index=None))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake_torch)
    line = ResourceSampler("cuda:0").line(INFO)
    assert "GPU 3.0 GiB used, 4.0 GiB reserved of 80.0 GiB" in line and "RAM " in line
    assert ResourceSampler("cpu").gpu() is None
