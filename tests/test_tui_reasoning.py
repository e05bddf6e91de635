"""The chat shows a model's reasoning folded and dimmed above its answer, while it streams and in the history, through
Textual's Pilot against the scripted FakeGenerator (its `reasoning` stands for the format of the model's template)."""

from __future__ import annotations

import sqlite3
import threading

from test_tui import chat_ready, run_app, send, wait_for
from textual.widgets import Input, Markdown, Static

from offspec.util.reasoning import HARMONY, THINK, ReasoningFormat
from tui.app import ChatApp
from tui.export import chat_markdown
from tui.fake import FakeGenerator, fake_factory
from tui.widgets import ChatView, MessageBubble, ReasoningFold

THOUGHT = "The user asks for 2+2. That is four."
ANSWER = "**4**, of course."
QWEN3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


def last_bubble(app: ChatApp) -> MessageBubble:
    return app.chat_screen.query_one(ChatView).bubbles()[-1]


def fold_of(bubble: MessageBubble) -> ReasoningFold:
    return bubble.query_one(ReasoningFold)


def fold_text(fold: ReasoningFold) -> str:
    return str(fold.query_one(".reasoning-text", Static).render())


def stored(data_dir) -> list[tuple]:
    with sqlite3.connect(data_dir / "history.sqlite3") as db:
        return db.execute("SELECT role, content, reasoning, status FROM messages ORDER BY id").fetchall()


def test_reasoning_streams_folded_and_dimmed_apart_from_the_answer(tmp_path):
    gate = threading.Semaphore(0)  # each pass of the fake takes a permit: the test lets them through
    fake = FakeGenerator(reply=QWEN3_REPLY, tokens_per_pass=2, gate=gate, reasoning=ReasoningFormat(THINK))

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        app.screen.query_one("#prompt", Input).value = "2+2?"
        await pilot.press("enter")
        gate.release(4)  # passes "<think>\n", "The user", " asks for", " 2+2. That": reasoning only so far
        bubble = last_bubble(app)
        fold = fold_of(bubble)
        await wait_for(pilot, lambda: bubble.reasoning == "The user asks for 2+2. That", "the first reasoning")
        assert fold.display and fold.collapsed and fold.title == "Thinking…"
        assert fold_text(fold) == "The user asks for 2+2. That"
        assert bubble.content == "" and bubble.query_one(Markdown).source == ""  # nothing reads as the answer

        gate.release(100)
        await wait_for(pilot, lambda: app.chat_screen.reply is None, "the reply to finish")
        assert bubble.reasoning == THOUGHT and bubble.content == ANSWER
        assert bubble.query_one(Markdown).source == ANSWER
        assert fold.collapsed and fold.title == "Reasoning · 8 words"
        body = fold.query_one(".reasoning-text", Static)
        assert body.styles.text_style.italic  # dimmed: muted and italic, unlike the answer
        assert body.styles.color != bubble.query_one(Markdown).styles.color

        await pilot.pause()  # the finished reply's layout
        assert await pilot.click(fold.query_one("CollapsibleTitle"))  # unfolded on a click
        await wait_for(pilot, lambda: not fold.collapsed, "the reasoning to unfold")
        assert fold_text(fold) == THOUGHT and body.region.height > 0
        fold.query_one("CollapsibleTitle").focus()
        await pilot.press("enter")  # and folded again with Enter on its title
        await wait_for(pilot, lambda: fold.collapsed, "the reasoning to fold")

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert stored(tmp_path) == [("user", "2+2?", "", "done"), ("assistant", ANSWER, THOUGHT, "done")]


def test_the_history_shows_the_reasoning_folded_and_the_engine_gets_the_answer_alone(tmp_path):
    first = FakeGenerator(reply=QWEN3_REPLY, reasoning=ReasoningFormat(THINK))

    async def ask(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "2+2?")

    run_app(ChatApp(fake_factory(first), data_dir=tmp_path), ask)
    second = FakeGenerator(reply="Yes.", reasoning=ReasoningFormat(THINK))

    async def reopen(app, pilot):
        await chat_ready(app, pilot)
        await app.chat_screen.open_chat(app.chat_screen.session.list_chats()[0].id)  # as Enter in the chat list
        bubble = last_bubble(app)
        assert bubble.content == ANSWER and bubble.reasoning == THOUGHT
        fold = fold_of(bubble)
        assert fold.display and fold.collapsed and fold.title == "Reasoning · 8 words"
        assert bubble.query_one(Markdown).source == ANSWER
        await send(app, pilot, "Sure?")
        reply = last_bubble(app)
        assert reply.content == "Yes." and not fold_of(reply).display  # a reply without reasoning: no fold

    run_app(ChatApp(fake_factory(second), data_dir=tmp_path), reopen)
    assert second.calls[0]["prompt"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": ANSWER},
                                         {"role": "user", "content": "Sure?"}]


def test_output_that_starts_inside_the_reasoning_and_harmony_channels(tmp_path):
    inside = FakeGenerator(reply=f"{THOUGHT}\n</think>\n\nFour.", reasoning=ReasoningFormat(THINK, inside=True))
    harmony = ("<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>"
               "It is 4.")

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "2+2?")
        bubble = last_bubble(app)
        assert (bubble.reasoning, bubble.content) == (THOUGHT, "Four.")
        inside.reply, inside.reasoning = harmony, ReasoningFormat(HARMONY)  # the next reply: gpt-oss's channels
        await send(app, pilot, "again")
        bubble = last_bubble(app)
        assert (bubble.reasoning, bubble.content) == ("Simple sum.", "It is 4.")
        assert bubble.query_one(Markdown).source == "It is 4."

    run_app(ChatApp(fake_factory(inside), data_dir=tmp_path), scenario)


def test_a_model_without_reasoning_markers_is_untouched(tmp_path):
    text = "<think>\nnot reasoning: this model's template has no markers\n</think>\n\nok"
    fake = FakeGenerator(reply=text)  # reasoning=None, as a Generator on such a template

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        await send(app, pilot, "hi")
        bubble = last_bubble(app)
        assert bubble.content == text and bubble.reasoning == "" and not fold_of(bubble).display

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert stored(tmp_path)[-1] == ("assistant", text, "", "done")


def test_stopping_while_it_reasons_keeps_the_reasoning(tmp_path):
    fake = FakeGenerator(reply=QWEN3_REPLY, tokens_per_pass=2, hold_after_passes=3, reasoning=ReasoningFormat(THINK))

    async def scenario(app, pilot):
        await chat_ready(app, pilot)
        app.screen.query_one("#prompt", Input).value = "2+2?"
        await pilot.press("enter")
        await wait_for(pilot, fake.holding.is_set, "the fake to hold mid-reasoning")
        bubble = last_bubble(app)
        await wait_for(pilot, lambda: bubble.reasoning == "The user asks for", "the reasoning so far")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat_screen.reply is None, "the cancelled reply to end")
        assert bubble.content == "" and fold_of(bubble).title == "Reasoning · 4 words"

    run_app(ChatApp(fake_factory(fake), data_dir=tmp_path), scenario)
    assert stored(tmp_path)[-1] == ("assistant", "", "The user asks for", "cancelled")


def test_the_export_folds_the_reasoning():
    from tui.history import StoredMessage

    reply = StoredMessage(2, 1, "assistant", ANSWER, reasoning=THOUGHT)
    text = chat_markdown("Sums", "", [StoredMessage(1, 1, "user", "2+2?"), reply], exported_at=0)
    assert f"## Assistant\n\n<details><summary>Reasoning</summary>\n\n{THOUGHT}\n\n</details>\n\n{ANSWER}\n" in text
