"""offspec.util.files: atomic writes, the temps of dead runs, file hashes."""

import hashlib
import os

import pytest

from offspec.util import files
from offspec.util.files import atomic_write, remove_stale_temps, sha256_file, temp_path

DEAD_PID = 2**22 + 12345  # above the default pid_max: no such process


def test_atomic_write_text_bytes_and_writer(tmp_path):
    path = tmp_path / "a.txt"
    assert atomic_write(path, "héllo\n") == path and path.read_text(encoding="utf-8") == "héllo\n"
    atomic_write(path, b"\x00\x01", fsync=False)
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, lambda f: (f.write(b"abc"), f.seek(0), f.write(b"X")))  # binary, opened for reading too
    assert path.read_bytes() == b"Xbc"
    atomic_write(path, lambda f: f.write("text"), encoding="utf-8")
    assert path.read_text() == "text"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, error):
    path = tmp_path / "a.json"
    path.write_text("old")

    def fails(f):
        f.write(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        atomic_write(path, fails)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_fsync_is_called_only_when_asked(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    atomic_write(tmp_path / "a", "x")
    atomic_write(tmp_path / "b", "x", fsync=False)
    assert len(calls) == 1


def test_temp_names_carry_the_pid(tmp_path):
    tmp = temp_path(tmp_path / "model.gguf")
    assert tmp.parent == tmp_path and tmp.name.startswith(f".model.gguf.tmp-{os.getpid()}-")
    assert temp_path(tmp_path / "d", "trash").name.startswith(f".d.trash-{os.getpid()}-")
    with pytest.raises(ValueError):
        temp_path(tmp_path / "d", "other")


def test_stale_temps_of_dead_processes_are_removed(tmp_path):
    dead_file = tmp_path / f".a.json.tmp-{DEAD_PID}-00ff"
    dead_dir = tmp_path / f".entry.trash-{DEAD_PID}-abcd"
    live = tmp_path / f".b.json.tmp-{os.getppid()}-1234"  # a live process's: not ours to remove
    own = temp_path(tmp_path / "c.json")
    dead_file.write_text("x")
    dead_dir.mkdir()
    (dead_dir / "layer.bin").write_bytes(b"x")
    for p in (live, own):
        p.write_text("x")
    kept = [tmp_path / "a.json", tmp_path / f".a.json.{DEAD_PID}.tmp", tmp_path / ".hidden"]  # not our temps
    for p in kept:
        p.write_text("x")
    assert sorted(remove_stale_temps(tmp_path)) == sorted([dead_file, dead_dir])
    assert all(p.exists() for p in [live, own, *kept])
    assert remove_stale_temps(tmp_path / "missing") == []


def test_legacy_temps_are_removed_once_untouched_a_while(tmp_path):
    fresh, old = tmp_path / ".m.live.partial", tmp_path / ".m.dead.partial"
    for p in (fresh, old):
        p.write_text("x")
    os.utime(old, (old.stat().st_mtime - 2 * files.STALE_SECONDS,) * 2)
    assert remove_stale_temps(tmp_path, legacy=(".m.*.partial",)) == [old]
    assert fresh.exists()


def test_sha256_file_reports_progress(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 * 1000 + 7)
    path.write_bytes(data)
    events = []
    assert sha256_file(path, progress=events.append, step="verify", message="m") == hashlib.sha256(data).hexdigest()
    assert events[-1].finished and events[-1].done == len(data) and events[-1].message == "m"
