"""End to end: the chat app on a tiny random real model, through `offspec.load` and the real generator."""

from __future__ import annotations

import sqlite3

from test_tui import chat_ready, run_app, view_texts, wait_for
from textual.widgets import Input
from helpers.tiny import save_tiny_model

from offspec.progress import ProgressEvent
from tui.app import ChatApp, engine_factory
from tui.settings import ChatSettings
from tui.widgets import StatusLine, TreePanel


def test_chat_on_a_tiny_real_model(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", arch="llama", seed=0, logit_scale=3.0)
    factory = engine_factory({"target": str(model), "draft": str(model), "device": "cpu", "dtype": "float32",
                              "max_context": 256, "budget": 8})
    steps: list[ProgressEvent] = []

    def recording_factory(progress):
        def both(event):
            steps.append(event)
            progress(event)

        return factory(both)

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        screen = app.chat_screen
        screen.session.update_settings(ChatSettings(temperature=0.0, max_new_tokens=12))
        await pilot.press("ctrl+t")
        for prompt in ("Hello there", "And again"):
            screen.query_one("#prompt", Input).value = prompt
            await pilot.press("enter")
            await wait_for(pilot, lambda: screen.reply is None, "the real reply")
        status = screen.query_one(StatusLine).text
        assert "tok/pass" in status and "budget 8 (fixed)" in status and "cpu float32" in status
        assert screen.query_one(TreePanel).snapshot is not None  # the engine's last tree reached the panel
        roles = [role for role, _ in view_texts(app)]
        assert roles == ["user", "assistant", "user", "assistant"]

    run_app(ChatApp(recording_factory, data_dir=tmp_path / "data"), scenario)
    assert any(e.step == "warmup" and e.finished for e in steps)
    with sqlite3.connect(tmp_path / "data" / "history.sqlite3") as db:
        rows = db.execute("SELECT role, status, stats FROM messages ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["user", "assistant", "user", "assistant"]
    assert all(r[1] == "done" for r in rows)
    assert '"stop_reason"' in rows[1][2]
