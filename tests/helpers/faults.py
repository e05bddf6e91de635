"""The contract and the places shared by the fault-injection tests (tests/test_faults.py and
tests/test_faults_history.py) and the source tests: run a command, check it ended in one error line (or that
an exception is one line), find temps left behind, make a directory read-only or a disk full."""


from __future__ import annotations

import errno
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]  # the repo root
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


def one_line(exc: pytest.ExceptionInfo) -> str:
    """The text of a raised error, checked to be one line."""
    text = str(exc.value)
    assert "\n" not in text, f"error is not one line: {text!r}"
    return text


def assert_no_temps(*dirs):
    left = []
    for d in dirs:
        if Path(d).exists():
            left += [p for p in Path(d).rglob("*") if any(mark in p.name for mark in TEMP_MARKS)]
    assert not left, f"temps left behind: {left}"


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
