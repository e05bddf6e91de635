"""Fault injection into the chat history (issue 15): a damaged database, a read-only or missing data dir, a
full disk. The contract is test_faults.py's: the chat starts, or one line says what to do; nothing that was
stored is lost; no temp file is left behind."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from pathlib import Path

import pytest
from helpers.faults import assert_no_temps, fill, read_only, small_disk

# == the chat history DB ===========================================================================


def make_history(data_dir: Path, chats: int = 12, turns: int = 20) -> dict[int, list[tuple[str, str]]]:
    """A history with chats of `turns` exchanges; returns {chat id: [(role, content), ...]}."""
    from tui.history import HistoryStore

    store = HistoryStore.open(data_dir)
    content = {}
    for c in range(chats):
        chat = store.create_chat(f"chat {c}")
        rows = []
        for t in range(turns):
            for role, text in (("user", f"question {c}.{t} " + "q" * 200), ("assistant", f"answer {c}.{t} " + "a" * 700)):
                store.add_message(chat.id, role, text)
                rows.append((role, text))
        content[chat.id] = rows
    store.close()  # the last connection checkpoints the WAL into the file
    return content


def damaged_histories(good: bytes):
    rng = random.Random(2)
    pages = len(good) // 4096
    for page in (1, 2, 3, 4, pages // 2, pages - 1):  # a whole page of random bytes: the header, roots, leaves
        data = bytearray(good)
        data[(page - 1) * 4096:page * 4096] = rng.randbytes(4096)
        yield f"page-{page}", bytes(data)
    for i in range(3):  # a short run of random bytes anywhere
        data = bytearray(good)
        at = rng.randrange(len(good) - 64)
        data[at:at + 64] = rng.randbytes(64)
        yield f"bytes-{i}", bytes(data)
    for size in (100, 4096 * 3 + 17, len(good) // 2):
        yield f"truncated-{size}", good[:size]


def open_chat_app(data_dir: Path):
    """Start the chat headlessly on a fake engine; returns (app, the notifications it showed)."""
    from tui.app import ChatApp
    from tui.fake import FakeGenerator, fake_factory

    app = ChatApp(fake_factory(FakeGenerator(reply="ok")), data_dir=data_dir)
    shown = []

    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + 20
            while not (app.chat_screen is not None and app.chat_screen.is_mounted):
                assert time.monotonic() < deadline, "the chat screen did not open"
                await pilot.pause(0.05)
            await pilot.pause(0.1)
            shown.extend(n.message for n in app._notifications)
            app.screen.query_one("#prompt").value = "still works?"
            await pilot.press("enter")
            while app.chat_screen.reply is not None:
                await pilot.pause(0.05)

    asyncio.run(main())
    return app, shown


def stored_rows(path: Path) -> list[tuple[int, str, str]]:
    with sqlite3.connect(path) as db:
        db.text_factory = lambda raw: raw.decode("utf-8", "replace")  # as the store reads it
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT chat_id, role, content FROM messages ORDER BY id").fetchall()


@pytest.mark.slow
def test_damaged_history_is_kept_as_a_backup_and_the_chat_starts(tmp_path):
    template = tmp_path / "template"
    original = make_history(template)
    good = (template / "history.sqlite3").read_bytes()
    everything = {text for rows in original.values() for _, text in rows}
    recovered_any = False
    for name, data in damaged_histories(good):
        data_dir = tmp_path / name
        data_dir.mkdir()
        (data_dir / "history.sqlite3").write_bytes(data)
        app, shown = open_chat_app(data_dir)  # never a traceback: the app opened and answered
        backups = sorted(data_dir.glob("history.sqlite3.corrupt-*"))
        rows = stored_rows(data_dir / "history.sqlite3")  # the history in use is sound
        assert rows[-2:] == [(rows[-1][0], "user", "still works?"), (rows[-1][0], "assistant", "ok")]
        if app.store.recovery is None:  # damage SQLite cannot see (inside text, unused space): used as is
            assert not backups
            continue
        assert [b.name for b in backups if not b.name.endswith(("-wal", "-shm"))] == [app.store.recovery.backup.name]
        assert app.store.recovery.backup.read_bytes() == data  # kept exactly as it was
        note = app.store.recovery.note()
        assert str(app.store.recovery.backup) in note and any(note == m for m in shown)  # said on screen
        salvaged = {content for _, _, content in rows[:-2]}
        assert salvaged <= everything  # what was salvaged is word for word what was written
        recovered_any |= bool(salvaged)
        assert_no_temps(data_dir)
    assert recovered_any  # the salvage did get rows out of damaged files


def test_restart_after_recovery_keeps_the_salvage_and_the_backup(tmp_path):
    make_history(tmp_path)
    path = tmp_path / "history.sqlite3"
    data = bytearray(path.read_bytes())
    data[2 * 4096:3 * 4096] = random.Random(5).randbytes(4096)
    path.write_bytes(bytes(data))
    from tui.history import HistoryStore

    first = HistoryStore.open(tmp_path)
    assert first.recovery is not None and first.recovery.messages > 0
    count = len(stored_rows(path))
    first.close()
    second = HistoryStore.open(tmp_path)  # the fresh file is sound: no second recovery, nothing lost
    assert second.recovery is None and len(stored_rows(path)) == count
    assert len([b for b in tmp_path.glob("history.sqlite3.corrupt-*") if b.suffix not in ("-wal", "-shm")]) == 1


def test_read_only_data_dir_with_a_healthy_history_says_read_only(tmp_path):
    from offspec import OffspecError
    from tui.app import ChatApp
    from tui.fake import FakeGenerator, fake_factory

    make_history(tmp_path, chats=1, turns=1)
    before = (tmp_path / "history.sqlite3").read_bytes()
    with read_only(tmp_path):
        with pytest.raises(OffspecError) as info:
            ChatApp(fake_factory(FakeGenerator()), data_dir=tmp_path)
    message = str(info.value)
    assert "read-only" in message and str(tmp_path) in message and "\n" not in message
    assert "unreadable" not in message and "damaged" not in message and "move" not in message
    assert (tmp_path / "history.sqlite3").read_bytes() == before


def test_missing_data_dir_is_created_and_a_file_in_the_way_is_one_line(tmp_path):
    from offspec import OffspecError
    from tui.history import HistoryStore

    store = HistoryStore.open(tmp_path / "new" / "deeper")
    assert store.list_chats() == []
    store.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffspecError, match="not a directory|cannot create"):
        HistoryStore.open(tmp_path / "file")


def test_history_on_a_full_disk_loses_nothing(tmp_path):
    """SQLite's page limit makes every write fail as on a full disk: the message stays in the input, the
    reply stays on screen, both are saved once there is room again."""
    from textual.widgets import Input

    from tui.app import ChatApp
    from tui.fake import FakeGenerator, fake_factory

    fake = FakeGenerator(reply="a reply that must not be lost")
    app = ChatApp(fake_factory(fake), data_dir=tmp_path)

    def disk(full: bool):
        db = app.store._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages if full else 2**30}")

    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            while not (app.chat_screen is not None and app.chat_screen.is_mounted):
                await pilot.pause(0.05)
            screen = app.chat_screen
            await send(pilot, screen, "x" * 20000)  # fills the last pages
            disk(full=True)
            await send(pilot, screen, "typed while the disk is full " + "y" * 20000)
            prompt = screen.query_one("#prompt", Input)
            assert prompt.value.startswith("typed while the disk is full")  # kept for another try
            assert fake.calls[-1]["prompt"][-1]["content"] == "x" * 20000  # nothing was sent
            errors = [n.message for n in app._notifications if "full" in n.message]
            assert errors and "\n" not in errors[0]
            disk(full=False)
            await pilot.press("enter")  # the same text again
            while screen.reply is not None:
                await pilot.pause(0.05)
            assert screen.session.unsaved == {}

    async def send(pilot, screen, text):
        screen.query_one("#prompt").value = text
        await pilot.press("enter")
        while screen.reply is not None:
            await pilot.pause(0.05)

    asyncio.run(main())
    rows = [(role, content[:28]) for _, role, content in stored_rows(tmp_path / "history.sqlite3")]
    assert rows == [("user", "x" * 28), ("assistant", "a reply that must not be lost"[:28]),
                    ("user", "typed while the disk is full"), ("assistant", "a reply that must not be lost"[:28])]


def test_reply_finished_while_the_disk_is_full_is_saved_later(tmp_path):
    from tui.history import HistoryStore
    from tui.session import ChatSession

    errors = []
    session = ChatSession(HistoryStore.open(tmp_path), on_error=errors.append)
    _, reply = session.start_turn("question")
    db = session.store._db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    session.finish_reply(reply.id, "z" * 50000, stop_reason="eos")
    assert reply.id in session.unsaved and len(errors) == 1 and "full" in errors[0]
    assert session.messages[-1].content == "z" * 50000  # the conversation goes on in memory
    db.execute("PRAGMA max_page_count = 1073741824")
    assert session.retry_unsaved() == 0
    assert session.store.get_message(reply.id).content == "z" * 50000
    assert session.store.get_message(reply.id).status == "done"


def test_history_on_a_real_full_disk_opens_or_says_so(tmp_path):
    data = tmp_path / "data"
    with small_disk(data, "64k"):
        fill(data)
        from offspec import OffspecError
        from tui.history import HistoryStore

        with pytest.raises(OffspecError, match="full") as info:
            HistoryStore.open(data)
        assert "\n" not in str(info.value)
        assert_no_temps(data)
