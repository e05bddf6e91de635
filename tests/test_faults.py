"""Fault injection (issue 15): damaged and truncated files, read-only, missing and full places, and
interrupts at each load phase a tiny model pair reaches.

The contract every case checks: the command ends in a correct result (the target's own greedy tokens),
or in ONE `error: ...` line on stderr with exit 2 (Ctrl-C: `interrupted`, exit 130), never a traceback;
nothing is lost or left corrupt; no temp file or directory is left behind; and after a kill, the same
command run again works.

Sections: the profile JSON, the chat history DB, directories (data, offload, cache, config), a full disk,
interrupts (SIGINT / SIGKILL), and a place for the weight files (safetensors, packed layer files, GGUF).
Read-only places use a read-only bind mount (root) or chmod (other users); where neither works the test
is skipped with the reason shown. A full disk is a small tmpfs where one can be mounted, else SQLite's
max_page_count or a write that raises ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
HARNESS = Path(__file__).parent / "fault_harness.py"
TEMP_MARKS = (".tmp", ".offspec-", "-tmp-", ".tmp-")  # every temp name offspec writes contains one of these


# -- the contract ---------------------------------------------------------------------------------


def run(args, env=None, harness=None, timeout=300):
    """`python main.py args...` (or through the fault harness: harness=(step, signal))."""
    cmd = [sys.executable, str(ROOT / "main.py"), *args] if harness is None else \
        [sys.executable, str(HARNESS), harness[0], harness[1], *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def assert_no_temps(*dirs):
    left = []
    for d in dirs:
        if Path(d).exists():
            left += [p for p in Path(d).rglob("*") if any(mark in p.name for mark in TEMP_MARKS)]
    assert not left, f"temps left behind: {left}"


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    return str(target), str(draft)


@pytest.fixture()
def places(tmp_path):
    """Fresh cache, config and data dirs for one case, in the environment of the commands it runs."""
    dirs = {name: tmp_path / name for name in ("cache", "config", "data")}
    env = {"OFFSPEC_CACHE_DIR": str(dirs["cache"]), "OFFSPEC_CONFIG_DIR": str(dirs["config"]),
           "OFFSPEC_DATA_DIR": str(dirs["data"])}
    return dirs, env


def generate_args(pair, *extra):
    return ["generate", "--target", pair[0], "--draft", pair[1], "--json", "--max-new-tokens", "12", *extra, "Hi"]


@pytest.fixture(scope="module")
def reference_tokens(pair, tmp_path_factory):
    """The target's own greedy tokens for the prompt every case uses."""
    root = tmp_path_factory.mktemp("reference")
    proc = run(generate_args(pair, "--no-speculate"), env={"OFFSPEC_CACHE_DIR": str(root / "c"),
                                                           "OFFSPEC_CONFIG_DIR": str(root / "p")})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["token_ids"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A 6-layer tiny pair and the flags that stream most of its target's layers: (pair, flags, reference)."""
    import re

    import offspec
    from tiny import save_tiny_model

    root = tmp_path_factory.mktemp("streamed")
    target = save_tiny_model(root / "target", arch="qwen2", seed=3, logit_scale=3.0, layers=6)
    draft = save_tiny_model(root / "draft", arch="qwen2", seed=3, logit_scale=3.0, layers=6, noise=0.02)
    flags = ["--max-context", "256", "--max-budget", "16", "--budget", "4"]
    with pytest.raises(offspec.OffspecError) as info:  # the error names the smallest budget that works
        offspec.load(str(target), str(draft), device_mem="1KB", offload_dir=str(root / "probe"), max_context=256,
                     max_budget=16, budget=4)
    flags += ["--device-mem", re.search(r"--device-mem (\S+)", str(info.value))[1]]
    pair = (str(target), str(draft))
    proc = run(generate_args(pair, "--no-speculate"), env={"OFFSPEC_CACHE_DIR": str(root / "c"),
                                                           "OFFSPEC_CONFIG_DIR": str(root / "p")})
    assert proc.returncode == 0, proc.stderr
    return pair, flags, json.loads(proc.stdout)["token_ids"]


def assert_correct(proc, reference):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["token_ids"] == reference  # lossless: the target's own greedy tokens


# -- read-only and full places --------------------------------------------------------------------


@contextmanager
def read_only(directory: Path):
    """Make `directory` read-only for this process (a read-only bind mount as root, chmod otherwise)."""
    directory = Path(directory)
    if os.geteuid() != 0:
        mode = directory.stat().st_mode
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(mode)
        return
    mounted = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a read-only directory needs a non-root user or mount rights: {mounted.stderr.decode().strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only: {ro.stderr.decode().strip()}")
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@contextmanager
def small_disk(directory: Path, size: str = "64k"):
    """A tiny tmpfs at `directory` (root only): writes past `size` fail with ENOSPC."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk of a real file system needs mount rights (root); the ENOSPC cases "
                    "with injected write failures still run")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def fill(directory: Path) -> None:
    """Fill the file system of `directory` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC


# == the profile JSON ==============================================================================


@pytest.fixture(scope="module")
def saved_profile(pair, tmp_path_factory):
    """A quick profile of the tiny pair in its own config dir: (config dir, profile file, bytes)."""
    root = tmp_path_factory.mktemp("profile")
    env = {"OFFSPEC_CONFIG_DIR": str(root / "config"), "OFFSPEC_CACHE_DIR": str(root / "cache")}
    proc = run(["profile", "--target", pair[0], "--draft", pair[1], "--quick", "--max-context", "256",
                "--prompts", "2", "--passes", "2"], env=env)
    assert proc.returncode == 0, proc.stderr
    [path] = (root / "config" / "profiles").glob("*.json")
    return root / "config", path, path.read_bytes()


def damaged_profiles(good: bytes):
    rng = random.Random(15)
    for i in range(2):  # random bytes at random places
        data = bytearray(good)
        at = rng.randrange(len(data) - 64)
        data[at:at + 64] = rng.randbytes(64)
        yield f"random-bytes-{i}", bytes(data)
    for fraction in (0.3, 0.9):
        yield f"truncated-{fraction}", good[:int(len(good) * fraction)]


def test_damaged_profile_gives_a_correct_result_or_one_line(pair, saved_profile, reference_tokens, tmp_path):
    config, path, good = saved_profile
    for name, data in damaged_profiles(good):
        case = tmp_path / name / "profiles"
        case.mkdir(parents=True)
        (case / path.name).write_bytes(data)
        proc = run(generate_args(pair), env={"OFFSPEC_CONFIG_DIR": str(case.parent),
                                             "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")})
        if proc.returncode == 0:
            assert_correct(proc, reference_tokens)  # the damage left valid JSON: the plan only sets the speed
        else:
            line = assert_one_line_error(proc, str(case / path.name))
            assert "offspec profile" in line or "delete it" in line, line  # says what to do
        assert (case / path.name).read_bytes() == data  # never rewritten behind the user's back
        assert_no_temps(case.parent)


def test_profile_save_on_a_full_disk_keeps_the_old_profile(saved_profile, monkeypatch, tmp_path):
    """A write that fails with ENOSPC (injected): one line, no temp, and the profile before is intact."""
    from offspec import OffspecError
    from offspec.profile import store

    _, path, good = saved_profile
    target = tmp_path / "p.json"
    target.write_bytes(good)
    data = json.loads(good)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "fsync", full)
    with pytest.raises(OffspecError, match="cannot write profile .*No space left on device") as info:
        store.save_profile(data, target)
    assert "\n" not in str(info.value)
    assert target.read_bytes() == good
    assert_no_temps(tmp_path)


def test_profile_on_a_real_full_disk_is_one_line(pair, tmp_path):
    config = tmp_path / "config"
    with small_disk(config, "64k"):
        fill(config)
        proc = run(["profile", "--target", pair[0], "--draft", pair[1], "--quick", "--max-context", "256",
                    "--prompts", "1", "--passes", "1"],
                   env={"OFFSPEC_CONFIG_DIR": str(config), "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")})
        assert_one_line_error(proc, "profile")
        assert_no_temps(config)


def test_profile_into_a_read_only_config_dir_is_one_line(pair, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    with read_only(config):
        proc = run(["profile", "--target", pair[0], "--draft", pair[1], "--quick", "--max-context", "256",
                    "--prompts", "1", "--passes", "1"],
                   env={"OFFSPEC_CONFIG_DIR": str(config), "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")})
        assert_one_line_error(proc, str(config))


def test_generate_with_a_read_only_config_dir_works(pair, reference_tokens, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    with read_only(config):
        proc = run(generate_args(pair), env={"OFFSPEC_CONFIG_DIR": str(config),
                                             "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")})
    assert_correct(proc, reference_tokens)


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


# == directories: offload, cache ===================================================================


@pytest.mark.parametrize("where", ["/proc/offspec-offload", "a file", "under a file"])
def test_unwritable_offload_dir_is_one_line_before_loading(pair, places, tmp_path, where):
    dirs, env = places
    (tmp_path / "file").write_text("x")
    path = {"a file": str(tmp_path / "file"), "under a file": str(tmp_path / "file" / "sub")}.get(where, where)
    start = time.monotonic()
    proc = run(generate_args(pair, "--offload-dir", path, "--device-mem", "10GB"), env=env)
    assert_one_line_error(proc, "offload dir", "--offload-dir")
    assert time.monotonic() - start < 60  # refused up front (the models are tiny anyway; no load happened)
    assert "loading" not in proc.stderr


def test_read_only_offload_dir_is_one_line(pair, places, tmp_path):
    dirs, env = places
    offload = tmp_path / "offload"
    offload.mkdir()
    with read_only(offload):
        proc = run(generate_args(pair, "--offload-dir", str(offload), "--device-mem", "10GB"), env=env)
    assert_one_line_error(proc, "read-only", "--offload-dir")


def test_missing_offload_dir_is_created_and_streaming_is_lossless(streamed, places, tmp_path):
    pair, flags, reference = streamed
    dirs, env = places
    offload = tmp_path / "not" / "there" / "yet"
    proc = run(generate_args(pair, "--offload-dir", str(offload), *flags), env=env)
    assert_correct(proc, reference)
    assert "streamed" in proc.stderr or list(offload.rglob("*")), proc.stderr  # the layers did stream from it
    assert_no_temps(offload, dirs["cache"])


def test_read_only_cache_dir(pair, places, reference_tokens, tmp_path):
    """Local models need nothing from the cache dir; streamed layers do, and say so in one line."""
    dirs, env = places
    dirs["cache"].mkdir()
    with read_only(dirs["cache"]):
        assert_correct(run(generate_args(pair), env=env), reference_tokens)
        proc = run(generate_args(pair, "--device-mem", "1MB"), env=env)
        assert_one_line_error(proc, "offload dir", str(dirs["cache"]))


# == interrupts at each load phase =================================================================

# (step, nth event of it, signal): every phase a tiny local pair reaches, each with one of the two signals
# (alternating, so both are covered at every kind of phase without doubling the suite's time).
# `generate` (budget auto): loading the target, loading the draft, the warm-up, the start-up estimate of the
# tree budget, planning it
GENERATE_PHASES = [("load", 1, "INT"), ("load", 3, "KILL"), ("warmup", 1, "INT"), ("estimate", 1, "KILL"),
                   ("budget", 1, "INT")]
# streaming the target's layers: packing them into per-layer files (offload), the placement, loading
OFFLOAD_PHASES = [
    ("pack", 1, "KILL"),  # the next start removes the temp of the killed pack (its process is gone)
    ("pack", 3, "INT"), ("placement", 1, "KILL"), ("load", 3, "INT")]
# `offspec profile`: the hardware and disk measurements, acceptance, tree growth timing
PROFILE_PHASES = [("hardware", 1, "INT"), ("disk", 2, "KILL"), ("acceptance", 1, "KILL"), ("propose", 1, "INT")]


def phase_id(phase):
    return f"{phase[0]}{phase[1]}-{phase[2]}" if isinstance(phase, tuple) else None


def _check_interrupt(proc, sig):
    if sig == "INT":
        assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("interrupted"), lines[-3:]  # and nothing drawn after it
    else:
        assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    assert "harness: signalled at" in proc.stderr  # the phase was reached


@pytest.mark.parametrize("phase", GENERATE_PHASES, ids=phase_id)
def test_interrupted_generate_then_restart(pair, places, reference_tokens, phase):
    dirs, env = places
    step, nth, sig = phase
    args = generate_args(pair)
    plain = [a for a in args if a != "--json"]  # progress shown (plain lines): nothing may follow `interrupted`
    _check_interrupt(run(plain, env=env, harness=(f"{step}:{nth}", sig)), sig)
    assert_no_temps(*dirs.values())
    assert_correct(run(args, env=env), reference_tokens)  # the next start works
    assert_no_temps(*dirs.values())


@pytest.mark.parametrize("phase", OFFLOAD_PHASES, ids=phase_id)
def test_interrupted_offloaded_load_then_restart(streamed, places, phase):
    pair, flags, reference = streamed
    dirs, env = places
    step, nth, sig = phase
    args = generate_args(pair, *flags)
    _check_interrupt(run([a for a in args if a != "--json"], env=env, harness=(f"{step}:{nth}", sig)), sig)
    assert_correct(run(args, env=env), reference)  # the next start works
    assert_no_temps(*dirs.values())


@pytest.mark.parametrize("phase", PROFILE_PHASES, ids=phase_id)
def test_interrupted_profile_writes_nothing_then_restart(pair, places, phase):
    dirs, env = places
    step, nth, sig = phase
    args = ["profile", "--target", pair[0], "--draft", pair[1], "--quick", "--max-context", "256",
            "--prompts", "1", "--passes", "1"]
    proc = run(args, env=env, harness=(f"{step}:{nth}", sig))
    _check_interrupt(proc, sig)
    if sig == "INT":
        assert "no profile was written" in proc.stderr
    assert not list(dirs["config"].rglob("*.json"))  # no partial profile
    again = run(args, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(list((dirs["config"] / "profiles").glob("*.json"))) == 1
    assert_no_temps(*dirs.values())


@pytest.mark.parametrize("sig", ["INT", "KILL"])
def test_interrupted_reply_then_restart(pair, places, reference_tokens, sig):
    dirs, env = places
    args = generate_args(pair, "--budget", "2")
    proc = run(args, env=env, harness=("reply:3", sig))  # inside the decode loop, after two passes
    _check_interrupt(proc, sig)
    assert proc.stdout == ""  # --json prints the whole result or nothing
    assert_correct(run(args, env=env), reference_tokens)
    assert_no_temps(*dirs.values())


# == weight files (issue 15 items 1, 4, 7) ========================================================
# A tiny GGUF pair converted into cache entries (offspec's weight store: one file per layer, the LM head and
# norms, the token table). Damage inside a store file (its size and mtime kept, as a bad sector would) is caught
# by the per-file checksum on first read and the entry is rebuilt; truncation by the size check at open; a
# conversion killed half way leaves a temp that the next start removes.


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    from tiny_gguf import save_tiny_gguf

    root = tmp_path_factory.mktemp("gguf-pair")
    target = save_tiny_gguf(root / "target.gguf", "qwen2", seed=0, layers=4)
    draft = save_tiny_gguf(root / "draft.gguf", "qwen2", seed=0, layers=4, noise=0.002)
    pair = (str(target), str(draft))
    proc = run(generate_args(pair, "--no-speculate"), env={"OFFSPEC_CACHE_DIR": str(root / "c"),
                                                           "OFFSPEC_CONFIG_DIR": str(root / "p")})
    assert proc.returncode == 0, proc.stderr
    return pair, json.loads(proc.stdout)["token_ids"]


def _store_files(cache: Path, kind: str) -> list[Path]:
    files = sorted((cache / "models").glob("target-*/weights/*.bin"))
    return [f for f in files if (kind == "layer") == f.name.startswith("layer")]


# a layer file (streamed or resident layers) and an extra (LM head, norms, token table), each with one damage
@pytest.mark.parametrize("kind,damage", [("layer", "random bytes"), ("extra", "truncated")])
def test_damaged_weight_store_is_rebuilt_and_the_result_is_correct(gguf_pair, places, kind, damage):
    pair, reference = gguf_pair
    dirs, env = places
    assert_correct(run(generate_args(pair), env=env), reference)  # converts both GGUFs
    files = _store_files(dirs["cache"], kind)
    assert files, sorted(p.name for p in dirs["cache"].rglob("*"))
    victim = files[len(files) // 2]
    stat = victim.stat()
    if damage == "random bytes":
        with open(victim, "r+b") as f:
            f.seek(stat.st_size // 2)
            f.write(os.urandom(min(4096, stat.st_size // 4)))
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    else:
        os.truncate(victim, stat.st_size // 2)
    assert_correct(run(generate_args(pair), env=env), reference)  # detected, rebuilt, then the same tokens
    assert_correct(run(generate_args(pair), env=env), reference)  # and the rebuilt entry is used as it is
    assert_no_temps(*dirs.values())


def test_conversion_killed_half_way_leaves_nothing_behind(gguf_pair, places):
    pair, reference = gguf_pair
    dirs, env = places
    proc = run([a for a in generate_args(pair) if a != "--json"], env=env, harness=("convert:2", "KILL"))
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    assert_correct(run(generate_args(pair), env=env), reference)  # the next start converts again
    assert_no_temps(*dirs.values())


def test_truncated_gguf_is_one_line_that_says_so(gguf_pair, places, tmp_path):
    pair, _ = gguf_pair
    dirs, env = places
    cut = tmp_path / "cut.gguf"
    data = Path(pair[0]).read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    proc = run(generate_args((str(cut), pair[1])), env=env)
    assert_one_line_error(proc, "truncated or damaged", "download it again")
    assert_no_temps(*dirs.values())
