"""The CPU kernels' old builds leave the cache: stamped on every load, removed by a new build when long unused."""

import os
import time

from offspec.formats import kernels
from offspec.formats.kernel_builds import MARKER, STALE_DAYS, last_used, mark_used, prune_stale_builds, stale_builds
from offspec.progress import ProgressEvent

DAY = 86400


def _build(root, name, age_days, marker=True, size=1000):
    directory = root / f"ggml-cpu-{name}"
    directory.mkdir(parents=True)
    (directory / "lib.so").write_bytes(b"x" * size)
    when = time.time() - age_days * DAY
    if marker:
        (directory / MARKER).write_text(name)
        os.utime(directory / MARKER, (when, when))
    os.utime(directory, (when, when))
    return directory


def test_only_builds_unused_for_the_stale_days_are_removed_and_never_the_one_in_use(tmp_path):
    keep = _build(tmp_path, "new", STALE_DAYS + 50)  # the build just made (its age does not matter)
    old = _build(tmp_path, "old", STALE_DAYS + 1, size=3000)
    recent = _build(tmp_path, "recent", STALE_DAYS - 1)
    broken = _build(tmp_path, "broken", STALE_DAYS + 5, marker=False)  # a build stopped half way, long ago
    building = _build(tmp_path, "building", 0, marker=False)  # another process building it now
    other = tmp_path / "notes"  # not a build: never touched
    other.mkdir()
    os.utime(other, (0, 0))
    assert stale_builds(tmp_path, keep) == [broken, old]
    pruned = prune_stale_builds(tmp_path, keep)
    assert (pruned.removed, pruned.failed) == (2, 0) and pruned.freed_bytes >= 3000 + 1000 + len("old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ggml-cpu-building", "ggml-cpu-new", "ggml-cpu-recent",
                                                         "notes"]
    assert recent.exists() and building.exists() and keep.exists()
    assert "removed 2 CPU kernel build(s) unused for 30 days" in pruned.message()


def test_a_load_stamps_its_build_as_used(tmp_path):
    build = _build(tmp_path, "b", STALE_DAYS + 10)
    assert time.time() - last_used(build) > STALE_DAYS * DAY
    mark_used(build)
    assert time.time() - last_used(build) < DAY
    assert stale_builds(tmp_path, tmp_path / "ggml-cpu-other") == []
    mark_used(tmp_path / "missing")  # nothing to stamp: no error


def test_a_build_that_cannot_be_removed_is_left_and_said(tmp_path, monkeypatch):
    keep = _build(tmp_path, "new", 0)
    _build(tmp_path, "old", STALE_DAYS + 1)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("offspec.formats.kernel_builds.shutil.rmtree", refuse)
    pruned = prune_stale_builds(tmp_path, keep)
    assert (pruned.removed, pruned.failed) == (0, 1)
    assert pruned.message().endswith("; 1 could not be removed (ggml-cpu-old: Permission denied)")


def test_a_new_build_prunes_the_old_ones_and_a_load_of_a_built_one_stamps_it(tmp_path, monkeypatch):
    """`_compile` with torch's extension loader replaced: what it does around the build."""
    monkeypatch.setenv("OFFSPEC_KERNELS_DIR", str(tmp_path))
    old = _build(tmp_path, "old", STALE_DAYS + 1)

    class FakeExt:
        def set_grid(self, type_id, grid):
            pass

    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda *args, **kwargs: FakeExt())
    events: list[ProgressEvent] = []
    kernels._compile(events.append, ["-mfake"])
    built = tmp_path / f"ggml-cpu-{kernels._build_id(['-mfake'])}"
    assert (built / MARKER).exists() and not old.exists()
    assert [e.message for e in events if "removed" in e.message] == [
        "removed 1 CPU kernel build(s) unused for 30 days (0 MB)"]
    when = time.time() - 40 * DAY
    os.utime(built / MARKER, (when, when))
    events.clear()
    kernels._compile(events.append, ["-mfake"])  # built already: loaded, stamped, nothing pruned or announced
    assert events == [] and time.time() - last_used(built) < DAY


def test_a_dead_builds_torch_lock_file_is_removed_once_our_flock_is_held(tmp_path):
    """torch's FileBaton `lock` outlives a killed build (issue 63: a later start waited for it forever); a live
    builder holds the flock, so one found under it is a dead build's."""
    from offspec.formats.kernels import _build_lock

    (tmp_path / "lock").write_text("")  # what a build killed by a memory cgroup left
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert (tmp_path / "offspec-build.flock").exists()
