"""The chat app driven through Textual's Pilot against the scripted FakeGenerator.

pytest-asyncio is not a dependency: each test runs its async scenario with asyncio.run.
"""

from __future__ import annotations

import asyncio
import io
import sqlite3
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable

import pytest
from textual.widgets import Input, Markdown, OptionList, ProgressBar

from offspec.errors import OffspecError
from tui.app import ChatApp, run_chat
from tui.fake import DEFAULT_REPLY, FakeGenerator, fake_factory, split_tokens
from tui.history import HistoryStore
from tui.screens import HelpScreen, LoadingScreen, SettingsScreen
from tui.screens.loading import StepRow
from tui.widgets import ChatList, ChatView, StatusLine, TreePanel

SIZE = (140, 44)
TIMEOUT = 15.0

Scenario = Callable[[ChatApp, object], Awaitable[None]]


def run_app(app: ChatApp, scenario: Scenario) -> ChatApp:
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(app, pilot)

    asyncio.run(main())
    return app


async def wait_for(pilot, predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def chat_ready(app: ChatApp, pilot) -> None:
    await wait_for(pilot, lambda: app.chat_screen is not None and app.chat_screen.is_mounted
                   and app.screen is app.chat_screen, "the chat screen")
    # let the screen's pending callbacks run: textual's Header sets its title in one after mounting, and a test
    # that ends right here would tear the header down under it (NoMatches 'HeaderTitle', seen once in CI)
    await pilot.pause()


async def send(app: ChatApp, pilot, text: str) -> None:
    """Type `text` into the prompt and press Enter; wait until the reply is finished."""
    prompt = app.screen.query_one("#prompt", Input)
    prompt.value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.chat_screen.reply is None, "the reply to finish")


def view_texts(app: ChatApp) -> list[tuple[str, str]]:
    return [(b.role, b.content) for b in app.chat_screen.query_one(ChatView).bubbles()]


def stored(data_dir: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(data_dir / "history.sqlite3") as db:
        return db.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()


def test_typed_prompt_streams_reply_into_view(tmp_path):
    fake = FakeGenerator()

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await pilot.press(*"hello", "enter")
        await wait_for(pilot, lambda: app.chat_screen.reply is None and fake.calls, "the reply")
        assert view_texts(app) == [("user", "hello"), ("assistant", DEFAULT_REPLY)]
        bubble = app.chat_screen.query_one(ChatView).bubbles()[-1]
        assert bubble.query_one(Markdown).source == DEFAULT_REPLY  # rendered as Markdown
        assert "tok/s" in app.chat_screen.query_one(StatusLine).text

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert fake.calls[0]["prompt"] == [{"role": "user", "content": "hello"}]
    assert stored(tmp_path) == [("user", "hello", "done"), ("assistant", DEFAULT_REPLY, "done")]


def test_escape_cancels_mid_stream_and_keeps_the_partial_reply(tmp_path):
    fake = FakeGenerator(tokens_per_pass=3, hold_after_passes=2)  # waits on the cancel event after 2 passes
    partial = "".join(split_tokens(DEFAULT_REPLY)[:6])

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        app.screen.query_one("#prompt", Input).value = "go"
        await pilot.press("enter")
        await wait_for(pilot, fake.holding.is_set, "the fake to hold mid-stream")
        bubble = app.chat_screen.query_one(ChatView).bubbles()[-1]
        await wait_for(pilot, lambda: bubble.content == partial, "the first passes in the view")
        assert app.chat_screen.reply is not None
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat_screen.reply is None, "the cancelled reply to end")
        assert view_texts(app)[-1] == ("assistant", partial)
        assert "cancelled" in app.chat_screen.query_one(StatusLine).text

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert stored(tmp_path)[-1] == ("assistant", partial, "cancelled")


def test_settings_change_what_the_engine_receives(tmp_path):
    fake = FakeGenerator(reply="ok")

    async def fill_settings(app, pilot, **values):
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings screen")
        for field_id, value in values.items():
            app.screen.query_one(f"#{field_id}", Input).value = value
        await pilot.press("ctrl+s")

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "first")
        await fill_settings(app, pilot, temperature="0.2", top_p="0.5", budget="16", max_new_tokens="40")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, "the settings to close")
        await send(app, pilot, "second")
        assert "budget 16 (fixed)" in app.chat_screen.query_one(StatusLine).text
        # Bad input: a one-line message, the form stays open and nothing changes.
        await fill_settings(app, pilot, budget="lots")
        await pilot.pause(0.05)
        assert isinstance(app.screen, SettingsScreen)
        error = str(app.screen.query_one("#settings-error").render())
        assert "budget must be 'auto' or a positive whole number" in error and "\n" not in error.strip()
        app.screen.query_one("#budget", Input).value = "auto"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, "the settings to close")
        await send(app, pilot, "third")

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    first, second, third = fake.calls
    assert (first["temperature"], first["top_p"], first["budget"]) == (0.7, 0.95, None)  # ChatSettings defaults
    assert (second["temperature"], second["top_p"], second["budget"], second["max_new_tokens"]) == (0.2, 0.5, 16, 40)
    assert (third["temperature"], third["budget"]) == (0.2, None)


def test_whole_conversation_and_system_prompt_are_sent_each_turn(tmp_path):
    fake = FakeGenerator(reply=lambda messages: f"reply {len(messages)}")

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "one")
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings screen")
        app.screen.query_one("#system_prompt").text = "Be brief."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, "the settings to close")
        await send(app, pilot, "two")

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert fake.calls[1]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "two"},
    ]


def test_history_survives_a_restart_and_chats_can_be_switched(tmp_path):
    async def first_run(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "remember me")
        await pilot.press("ctrl+n")
        await send(app, pilot, "another chat")

    run_app(ChatApp(fake_factory(FakeGenerator(reply="noted")), data_dir=tmp_path), first_run)

    async def second_run(app, pilot):
        await chat_ready(app, pilot)
        assert view_texts(app) == []  # a new chat; the saved ones are in the list
        chats = app.chat_screen.query_one(ChatList)
        assert chats.is_shown and chats.query_one(OptionList).option_count == 2
        await pilot.press("ctrl+o")  # focus the list (most recent first)
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: view_texts(app) == [("user", "remember me"), ("assistant", "noted")],
                       "the older chat to open")
        await send(app, pilot, "and again")
        assert view_texts(app)[-2:] == [("user", "and again"), ("assistant", "noted")]

    fake = FakeGenerator(reply="noted")
    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), second_run)
    assert [m["content"] for m in fake.calls[0]["prompt"]] == ["remember me", "noted", "and again"]


def test_failing_loader_shows_the_error_and_exits_non_zero(tmp_path):
    error = OffspecError("target 'nope' not found; pass --target a local directory or a hub name")

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: app.loading_screen is not None and app.loading_screen.error is not None,
                       "the load to fail")
        screen = app.screen
        assert isinstance(screen, LoadingScreen)
        what = str(screen.query_one("#failure .what").render())
        assert "Loading failed during 'Warm up'" in what and "target 'nope' not found" in what
        assert "offspec chat" in str(screen.query_one("#failure .todo").render())
        marks = {row.step: row.state for row in screen.query(StepRow)}
        assert marks == {"load": "done", "warmup": "failed"}
        await pilot.press("q")

    app = run_app(ChatApp(fake_factory(fail=error), data_dir=tmp_path), scenario)
    assert app.return_code == 1
    assert app.load_error.startswith("Loading failed during 'Warm up': target 'nope' not found")


def test_ctrl_q_on_a_failed_load_exits_non_zero(tmp_path):
    async def scenario(app, pilot):
        await wait_for(pilot, lambda: app.loading_screen is not None and app.loading_screen.error is not None,
                       "the load to fail")
        await pilot.press("ctrl+q")
        await pilot.pause()

    app = run_app(ChatApp(fake_factory(fail=OffspecError("target 'nope' not found")), data_dir=tmp_path), scenario)
    assert app.return_code == 1


def test_unexpected_load_error_points_to_a_log(tmp_path):
    async def scenario(app, pilot):
        await wait_for(pilot, lambda: app.loading_screen is not None and app.loading_screen.error is not None,
                       "the load to fail")
        todo = str(app.screen.query_one("#failure .todo").render())
        assert "chat-errors.log" in todo
        await pilot.press("enter")

    app = run_app(ChatApp(fake_factory(fail=RuntimeError("boom")), data_dir=tmp_path), scenario)
    assert app.return_code == 1 and "RuntimeError: boom" in app.load_error
    assert "RuntimeError: boom" in (tmp_path / "chat-errors.log").read_text()


def test_loading_screen_shows_each_step_with_progress(tmp_path):
    from offspec.progress import ProgressEvent

    gate = threading.Event()

    def factory(progress):
        progress(ProgressEvent("assemble", "assembling target weights", done=10, total=10, finished=True))
        progress(ProgressEvent("load", "loading layers", done=3, total=12))
        progress(ProgressEvent("warmup", "warming up"))
        gate.wait(TIMEOUT)
        return FakeGenerator()

    async def scenario(app, pilot):
        await wait_for(pilot, lambda: len(app.screen.query(StepRow)) == 3, "three steps")
        rows = {row.step: row for row in app.screen.query(StepRow)}
        bar = rows["load"].query_one(ProgressBar)
        await wait_for(pilot, lambda: bar.percentage is not None, "the load step's progress bar")
        assert bar.percentage == pytest.approx(0.25)
        assert rows["assemble"].state == "done"
        assert rows["load"].state == "running" and rows["load"].event.done == 3
        gate.set()
        await chat_ready(app, pilot)

    run_app(ChatApp(factory, data_dir=tmp_path), scenario)


def test_screenshot_of_the_main_screen_shows_status_and_tree(tmp_path):
    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "show me")
        await pilot.press("ctrl+t")
        await pilot.pause(0.1)
        assert app.chat_screen.query_one(TreePanel).is_shown
        path = Path(app.save_screenshot("main.svg", path=str(tmp_path)))
        svg = path.read_text(encoding="utf-8").replace("&#160;", " ")
        for expected in ("tok/s", "tok/pass", "budget 32 (profile)", "ms weights", "Speculation tree",
                         "accepted", "New chat", "fake-target"):
            assert expected in svg, expected

    run_app(ChatApp(fake_factory(FakeGenerator()), data_dir=tmp_path / "data"), scenario)


def test_copy_export_help_and_command_palette(tmp_path):
    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "export this")
        await pilot.press("ctrl+y")
        assert app.clipboard == DEFAULT_REPLY
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: len(list((tmp_path / "exports").glob("*.md"))) == 1, "the export")
        exports = list((tmp_path / "exports").glob("*.md"))
        text = exports[0].read_text()
        assert "# export this" in text and "## You\n\nexport this" in text and DEFAULT_REPLY in text
        assert any(str(exports[0]) in str(n.message) for n in app._notifications)
        # A focused message copies itself with c.
        app.chat_screen.query_one(ChatView).bubbles()[0].focus()
        await pilot.press("c")
        assert app.clipboard == "export this"
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        await pilot.press("escape")
        # The command palette runs the chat's actions.
        await wait_for(pilot, lambda: app.screen is app.chat_screen, "the chat screen")
        await pilot.press("ctrl+p")
        await pilot.press(*"new chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.chat_screen and view_texts(app) == [], "a new chat")

    run_app(ChatApp(fake_factory(FakeGenerator()), data_dir=tmp_path), scenario)


def test_generation_error_is_shown_and_partial_text_kept(tmp_path):
    class Failing(FakeGenerator):
        def stream(self, prompt, **kwargs):
            events = super().stream(prompt, **kwargs)
            yield next(events)
            raise RuntimeError("device lost")

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "hi")
        assert view_texts(app)[-1] == ("assistant", "Here is a")
        assert any("device lost" in str(n.message) for n in app._notifications)

    run_app(ChatApp(fake_factory(Failing()), data_dir=tmp_path), scenario)
    assert stored(tmp_path)[-1] == ("assistant", "Here is a", "error")


def test_the_status_line_counts_the_wait_for_the_first_token_and_stops_when_the_reply_fails(tmp_path):
    gate = threading.Semaphore(0)  # the fake's first pass waits for a permit: the prompt is still "being read"

    class FailsBeforeAnyToken(FakeGenerator):
        def stream(self, prompt, **kwargs):
            if prompt[-1]["content"] == "fail":
                raise RuntimeError("device lost")
            yield from super().stream(prompt, **kwargs)

    fake = FailsBeforeAnyToken(gate=gate)

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        status = app.chat_screen.query_one(StatusLine)
        app.screen.query_one("#prompt", Input).value = "hi"
        await pilot.press("enter")
        await wait_for(pilot, lambda: status.speed.startswith("waiting for the first token · "), "the waiting line")
        for _ in range(100):
            gate.release()
        await wait_for(pilot, lambda: app.chat_screen.reply is None, "the reply to finish")
        assert "tok/s" in status.speed and "waiting" not in status.speed
        await send(app, pilot, "fail")
        assert any("device lost" in str(n.message) for n in app._notifications)
        assert status.speed.startswith("ready · ")  # not a wait that goes on counting after the failure

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)


def test_quit_during_generation_saves_the_reply(tmp_path):
    fake = FakeGenerator(hold_after_passes=1)

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        app.screen.query_one("#prompt", Input).value = "long one"
        await pilot.press("enter")
        await wait_for(pilot, fake.holding.is_set, "the fake to hold")
        bubble = app.chat_screen.query_one(ChatView).bubbles()[-1]
        await wait_for(pilot, lambda: bubble.content == "Here is a", "the first pass")
        await pilot.press("ctrl+q")

    app = run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert app.return_code == 0
    assert stored(tmp_path)[-1] == ("assistant", "Here is a", "cancelled")
    HistoryStore.open(tmp_path).close()  # still a healthy database


def test_run_chat_without_a_terminal_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(OffspecError) as info:
        run_chat({"target": "x"}, data_dir=tmp_path)
    message = str(info.value)
    assert "interactive terminal" in message and "\n" not in message


def test_view_follows_the_reply_only_while_at_the_bottom(tmp_path):
    import threading

    gate = threading.Semaphore(0)
    fake = FakeGenerator(reply="".join(f"line {i}\n\n" for i in range(400)), tokens_per_pass=10, gate=gate)

    async def grow(pilot, bubble, passes: int) -> None:
        """Let `passes` more passes through and wait until the Markdown has rendered all of it."""
        before = len(bubble.content)
        gate.release(passes)
        markdown = bubble.query_one(Markdown)
        settled = []

        def rendered() -> bool:
            settled.append((len(bubble.content), markdown.source == bubble.content))
            return len(bubble.content) > before and settled[-1][1] and settled[-5:].count(settled[-1]) == 5

        await wait_for(pilot, rendered, "the text to render")
        await pilot.pause(0.1)

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        app.screen.query_one("#prompt", Input).value = "long"
        await pilot.press("enter")
        view = app.chat_screen.query_one(ChatView)
        await wait_for(pilot, lambda: len(view.bubbles()) == 2, "the reply bubble")
        bubble = view.bubbles()[-1]
        await grow(pilot, bubble, 30)
        assert view.max_scroll_y > 20 and view.scroll_y == view.max_scroll_y  # following
        await pilot.press("pageup")
        await pilot.pause(0.2)
        parked = view.scroll_y
        assert parked < view.max_scroll_y
        await grow(pilot, bubble, 20)
        assert view.scroll_y == parked and view.max_scroll_y > parked  # left where the user put it
        view.scroll_end(animate=False)
        await pilot.pause(0.2)
        await grow(pilot, bubble, 20)
        assert view.scroll_y == view.max_scroll_y  # at the bottom again: follows again
        await pilot.press("escape")
        gate.release(1000)
        await wait_for(pilot, lambda: app.chat_screen.reply is None, "the reply to stop")

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
