"""Fault injection (issue 15): damaged and truncated files, read-only, missing and full places, and
interrupts at each load phase a tiny model pair reaches.

The contract every case checks: the command ends in a correct result (the target's own greedy tokens),
or in ONE `error: ...` line on stderr with exit 2 (Ctrl-C: `interrupted`, exit 130), never a traceback;
nothing is lost or left corrupt; no temp file or directory is left behind; and after a kill, the same
command run again works.

Sections: the profile JSON, directories (offload, cache, config), interrupts (SIGINT / SIGKILL), and a
place for the weight files (safetensors, packed layer files, GGUF). The chat history DB has its own file
(tests/test_faults_history.py); the helpers both use are in tests/helpers/faults.py.
Read-only places use a read-only bind mount (root) or chmod (other users); where neither works the test
is skipped with the reason shown. A full disk is a small tmpfs where one can be mounted, else SQLite's
max_page_count or a write that raises ENOSPC.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from helpers.faults import assert_no_temps, assert_one_line_error, fill, read_only, run, small_disk

pytestmark = pytest.mark.slow  # every case runs `python main.py` in a subprocess, some several times


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

    from helpers.tiny import save_tiny_model

    import offspec

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
    from helpers.tiny_gguf import save_tiny_gguf

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
