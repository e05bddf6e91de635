"""Issue 15's command-line defects: options checked before loading, chat takes generate's generation
options, progress on a non-terminal, nothing drawn after `interrupted`, the flag named in messages."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest

import offspec
from offspec import OffspecError
from offspec.cli.main import _parser, generation_options, main
from offspec.cli.progress import TqdmProgress
from offspec.progress import ProgressEvent

ROOT = Path(__file__).parent.parent


def run(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


BAD_OPTIONS = [
    (["--max-new-tokens", "0"], "max_new_tokens must be a positive whole number"),
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--temperature", "inf"], "temperature must be a number >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be a whole number >= 0"),
    (["--seed", "-5"], "seed must be a whole number >= 0"),
    (["--max-budget", "0"], "max_budget must be a positive whole number"),
    (["--max-context", "1"], "max_context must be a whole number > 1"),
    (["--threads", "0"], "threads must be a positive whole number"),
    (["--budget", "100", "--max-budget", "10"], "raise it with --max-budget 100"),
    (["--chain", "0"], "budget must be a positive integer"),
    (["--device-mem", "banana"], "device_mem"),
    (["--draft-vocab", "lots"], "draft_vocab must be auto, full or a token count"),
]


@pytest.mark.parametrize("command", ["generate", pytest.param("chat", marks=pytest.mark.slow)])
def test_bad_options_are_refused_before_any_model_is_touched(command, capsys):
    """The target does not exist: an error about the option proves nothing was loaded or even looked up."""
    for extra, message in BAD_OPTIONS:
        args = [command, "--target", "/nonexistent/model", *extra] + (["hello"] if command == "generate" else [])
        assert main(args) == 2, extra
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], (extra, lines)
        assert "not found" not in lines[0] and "terminal" not in lines[0]
    proc = run(command, "--target", "/nonexistent/model", "--top-p", "1.5", *(["hi"] if command == "generate" else []))
    assert proc.returncode == 2 and proc.stderr.startswith("error: top_p must be in (0, 1]"), proc.stderr


def test_budget_above_max_budget_names_the_flag_and_the_python_option():
    with pytest.raises(OffspecError) as info:
        offspec.load("/nonexistent", budget=64, max_budget=8)
    assert "--max-budget 64" in str(info.value) and "max_budget=64" in str(info.value)


@pytest.mark.slow
def test_chat_takes_the_generation_options_of_generate():
    generate = {a.dest for a in _parser()._subparsers._group_actions[0].choices["generate"]._actions}
    chat = {a.dest for a in _parser()._subparsers._group_actions[0].choices["chat"]._actions}
    assert {"temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "speculate"} <= generate & chat
    args = _parser().parse_args(["chat", "--temperature", "0.2", "--max-new-tokens", "5", "--top-k", "3",
                                 "--stop", "END", "--no-speculate", "--seed", "7"])
    assert generation_options(args) == {"temperature": 0.2, "max_new_tokens": 5, "top_k": 3, "stop": ["END"],
                                        "speculate": False, "seed": 7}
    assert generation_options(_parser().parse_args(["chat"])) == {}  # nothing given: the chat's own settings
    # without a terminal the chat refuses in one line, after accepting the options
    proc = run("chat", "--temperature", "0.2", "--max-new-tokens", "5")
    assert proc.returncode == 2 and "interactive terminal" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_options_reach_the_engine_and_are_not_saved(tmp_path):
    from tui.app import ChatApp
    from tui.fake import FakeGenerator, fake_factory
    from tui.history import HistoryStore
    from tui.session import SETTINGS_KEY

    fake = FakeGenerator(reply="ok")
    options = {"temperature": 0.2, "max_new_tokens": 5, "top_k": 3, "stop": ["END"], "speculate": False, "seed": 7}
    app = ChatApp(fake_factory(fake), data_dir=tmp_path, generation=options)

    async def main_():
        async with app.run_test(size=(120, 40)) as pilot:
            while not (app.chat_screen is not None and app.chat_screen.is_mounted):
                await pilot.pause(0.05)
            app.chat_screen.query_one("#prompt").value = "hi"
            await pilot.press("enter")
            while app.chat_screen.reply is None and not fake.calls:
                await pilot.pause(0.05)
            while app.chat_screen.reply is not None:
                await pilot.pause(0.05)

    asyncio.run(main_())
    call = fake.calls[0]
    assert (call["temperature"], call["max_new_tokens"], call["top_k"], call["stop"], call["speculate"],
            call["seed"]) == (0.2, 5, 3, ("END",), False, 7)
    assert HistoryStore.open(tmp_path).get_setting(SETTINGS_KEY) is None  # a session's flags, not saved
    with pytest.raises(OffspecError, match="max_new_tokens"):
        ChatApp(fake_factory(fake), data_dir=tmp_path, generation={"max_new_tokens": 0})


# -- progress -------------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_off_a_terminal_is_plain_periodic_lines():
    out, clock = io.StringIO(), Clock()
    progress = TqdmProgress(stream=out, tty=False, interval=10.0, clock=clock)
    total = 3 * 2**30
    progress(ProgressEvent("convert", "converting target", 0, total))
    for i in range(1, 100):  # 99 updates over 99 seconds
        clock.now = float(i)
        progress(ProgressEvent("convert", "converting target", total * i / 100, total))
    clock.now = 100.0
    progress(ProgressEvent("convert", "converting target", total, total, finished=True))
    progress(ProgressEvent("warmup", "warming up"))
    progress(ProgressEvent("warmup", "warming up", finished=True))
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "converting target ..."
    assert 8 <= len(lines) - 4 <= 10  # one line every 10 s of the 100, not one per update
    assert lines[1] == "converting target: 10% (322MB of 3.22GB)"
    assert lines[-3] == "converting target: done in 100.0 s"
    assert lines[-2:] == ["warming up ...", "warming up: done in 0.0 s"]


def test_progress_on_a_terminal_draws_bars_and_closes_them():
    out = io.StringIO()
    with TqdmProgress(stream=out, tty=True) as progress:
        progress(ProgressEvent("load", "loading", 1, 4))
        assert "load" in progress.bars
    assert progress.bars == {} and "loading" in out.getvalue()


def test_nothing_is_drawn_after_interrupted(monkeypatch, capsys):
    """Ctrl-C while a bar is open: the bar is closed first, `interrupted` is the last line (exit 130)."""
    def load(progress=None, **options):
        progress(ProgressEvent("convert", "converting target", 5, 10))
        raise KeyboardInterrupt

    monkeypatch.setattr(offspec, "load", load)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["generate", "--target", "/x", "hello"]) == 130
    err = capsys.readouterr().err
    assert err.rstrip("\n").split("\n")[-1] == "interrupted", repr(err[-300:])


def test_errors_after_progress_are_the_last_line(monkeypatch, capsys):
    def load(progress=None, **options):
        progress(ProgressEvent("convert", "converting target", 5, 10))
        raise OffspecError("the disk is full")

    monkeypatch.setattr(offspec, "load", load)
    assert main(["generate", "--target", "/x", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip("\n").split("\n")[-1] == "error: the disk is full"
