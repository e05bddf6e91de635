"""Profiles on disk: round trip, schema errors naming file and field, atomic writes, shipped files."""

import json
from pathlib import Path

import pytest

from offspec import OffspecError
from offspec.profile import store
from offspec.profile.schema import AcceptanceFile, json_schema, validate

ROOT = Path(__file__).parent.parent


def measured_profile() -> dict:
    key = store.profile_key({"device_type": "cpu", "device_name": "Test CPU"}, {"target": "t", "draft": "d"}, None)
    return {
        "format": "offspec-profile", "version": 1, "kind": "measured", "name": "test", "created": "2025-01-01",
        "sources": ["synthetic, for tests"], "fingerprint": store.fingerprint(key), "key": key,
        "hardware": {"device_type": "cpu", "device_name": "Test CPU", "device_memory_bytes": None,
                     "host_ram_bytes": 8 * 10**9, "cpu": "Test CPU", "cpu_cores": 2},
        "models": {"target": "t", "draft": "d", "dtype": "float32"},
        "timings": {"context_tokens": 20, "target_pass": [[1, 0.3], [16, 0.6], [64, 1.7]],
                    "target_head_seconds": 0.01, "draft_step": [[1, 0.1], [8, 0.12]],
                    "draft_propose": [[1, 0.1], [4, 0.3]], "expand_ratio": 0.9, "calibration_depth": 64},
        "acceptance": {"budgets": [1, 2, 4], "accepted": [0.6, 0.9, 1.3], "depths": [1, 2, 2.5],
                       "samples": [[1, 1, 2], [0, 1, 1]], "temperature": 0.0, "prompts": 1, "passes": 2},
        "plan": {"budget": 4, "max_beams": 4, "max_depth": 32, "predicted_tokens_per_second": 3.0},
    }


def test_round_trip(tmp_path):
    data = measured_profile()
    path = store.save_profile(data, tmp_path / "sub" / "p.json")
    assert store.load_profile(path) == data
    assert store.costs_of(data).target_pass(16) == pytest.approx(0.6)
    assert store.acceptance_of(data)(2) == pytest.approx(0.9)
    assert not list(path.parent.glob(".*tmp"))


@pytest.mark.parametrize("edit, field, message", [
    (lambda d: d["timings"].pop("target_pass"), "timings.target_pass", "is missing"),
    (lambda d: d["timings"]["target_pass"][1].__setitem__(1, "fast"), "timings.target_pass[1][1]", "expected a number"),
    (lambda d: d["hardware"].__setitem__("cpu_cores", "two"), "hardware.cpu_cores", "expected an integer"),
    (lambda d: d.__setitem__("kind", "guess"), "kind", "expected one of"),
    (lambda d: d.pop("acceptance"), "acceptance", "is missing"),  # required for a measured profile
    (lambda d: d["acceptance"]["accepted"].pop(), "acceptance.accepted", "one value per budget"),
    (lambda d: d["acceptance"]["samples"][1].pop(), "acceptance.samples[1]", "one count per budget"),
    (lambda d: d["hardware"].__setitem__("host_ram_bytes", -1), "hardware.host_ram_bytes", ">= 0"),
])
def test_schema_errors_name_the_file_and_the_field(tmp_path, edit, field, message):
    data = measured_profile()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(OffspecError) as info:
        store.load_profile(path)
    text = str(info.value)
    assert str(path) in text and f"field {field}" in text and message in text, text
    assert "\n" not in text


def test_bad_json_and_newer_version_are_clear(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "offspec-profile",\n "version": }')
    with pytest.raises(OffspecError, match=r"broken.json: not valid JSON at line 2"):
        store.load_profile(path)
    data = measured_profile()
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(OffspecError, match="version 99 is newer"):
        store.load_profile(path)
    with pytest.raises(OffspecError, match="not found"):
        store.load_profile(tmp_path / "missing.json")


def test_interrupted_save_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    store.save_profile(measured_profile(), path)
    before = path.read_text()
    changed = measured_profile()
    changed["name"] = "changed"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.save_profile(changed, path)
    assert path.read_text() == before  # the old profile is intact
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left behind


def test_invalid_profile_is_never_written(tmp_path):
    data = measured_profile()
    del data["hardware"]["device_type"]
    with pytest.raises(OffspecError, match="hardware.device_type is missing"):
        store.save_profile(data, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_fingerprint_ignores_volatile_placement_fields():
    hw, models = {"device_type": "cuda", "device_name": "GPU"}, {"target": "t", "draft": "d"}
    a = {"device": "cuda", "layers": {"device": 10, "ram": 20, "ssd": 0}, "device_budget": 123,
         "predicted_pass_seconds": 1.0}
    b = dict(a, device_budget=456, predicted_pass_seconds=2.0)
    c = dict(a, layers={"device": 12, "ram": 18, "ssd": 0})
    fp = lambda p: store.fingerprint(store.profile_key(hw, models, p))  # noqa: E731
    assert fp(a) == fp(b)
    assert fp(a) != fp(c) and fp(a) != fp(None)


def test_find_profile_in_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path))
    data = measured_profile()
    assert store.find_profile(data["key"]) is None
    store.save_profile(data, store.profile_path(data["key"]))
    assert store.find_profile(data["key"]) == tmp_path / "profiles" / f"{data['fingerprint']}.json"


def test_stale_profiles_are_those_of_another_kernel_build_or_draft_head_only(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path))
    hw = {"device_type": "cpu", "device_name": "Test CPU"}
    key = store.profile_key(hw, {"target": "t", "draft": "d", "kernels": "compiled new"}, None)
    assert store.stale_profiles(key) == []  # no profiles dir yet

    def saved(models, placement=None):
        data = measured_profile()
        data["key"] = store.profile_key(hw, models, placement)
        data["fingerprint"] = store.fingerprint(data["key"])
        return store.save_profile(data, store.profile_path(data["key"]))

    old = saved({"target": "t", "draft": "d", "kernels": "compiled old"})
    saved({"target": "t", "draft": "d", "kernels": "compiled new"})  # the current one: found by find_profile instead
    saved({"target": "other", "draft": "d", "kernels": "compiled old"})  # another pair
    saved({"target": "t", "draft": "d", "kernels": "compiled old"}, {"device": "cpu", "tiers": ["ssd"]})  # placed
    (tmp_path / "profiles" / "broken.json").write_text("{not json")
    (tmp_path / "profiles" / "list.json").write_text("[1, 2]")
    (tmp_path / "profiles" / "odd.json").write_text(json.dumps({"key": {"models": ["t"]}}))
    assert store.stale_profiles(key) == [(old, "another build of offspec's CPU kernels")]
    # a profile measured with another draft head (--draft-vocab), or with a whole one where it is now reduced
    reduced = store.profile_key(hw, {"target": "t", "draft": "d", "kernels": "compiled new", "draft_vocab": 65558}, None)
    whole = store.find_profile(key)
    assert sorted(store.stale_profiles(reduced)) == sorted([
        (old, "another build of offspec's CPU kernels and another draft vocabulary (--draft-vocab)"),
        (whole, "another draft vocabulary (--draft-vocab)")])


def test_acceptance_profiles_are_the_same_pairs_in_any_placement_machine_or_build(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path))
    hw = {"device_type": "cpu", "device_name": "Test CPU"}
    pair = {"target": "t", "draft": "d", "kernels": "compiled new"}
    key = store.profile_key(hw, pair, None)
    assert store.acceptance_profiles(key) == []  # no profiles dir yet

    def saved(models, placement=None, hardware=hw, created="2025-01-01"):
        data = measured_profile()
        data["key"], data["created"] = store.profile_key(hardware, models, placement), created
        data["fingerprint"] = store.fingerprint(data["key"])
        return store.save_profile(data, store.profile_path(data["key"]))

    saved(pair)  # this very set-up: find_profile's, not listed
    placed = saved(pair, {"device": "cpu", "tiers": ["ssd"]}, created="2025-03-01")  # another placement
    gpu = saved(pair, hardware={"device_type": "cuda", "device_name": "Test GPU"}, created="2025-02-01")
    built = saved({**pair, "kernels": "compiled old"}, created="2024-12-01")  # another build of the kernels
    saved({**pair, "draft_vocab": 1000})  # another draft head: another acceptance
    saved({**pair, "draft": "other"})  # another pair
    (tmp_path / "profiles" / "broken.json").write_text("{not json")
    assert store.acceptance_profiles(key) == [built, gpu, placed]  # oldest first


def test_shipped_reference_profiles_are_valid_and_documented():
    files = store.reference_profiles()
    stems = {p.stem for p in files}
    assert {"rtx3060-12gb", "rtx3090", "rtx4090", "rtx4060ti-16gb", "a100-80gb", "h100-80gb", "cpu-2core"} <= stems
    for path in files:
        data = store.load_profile(path)
        assert data["sources"] and all(len(s) > 20 for s in data["sources"]), path
        hw = data["hardware"]
        assert hw["device_memory_bandwidth"] and hw["device_flops"] and hw["disk_read_bytes_per_s"], path
    assert store.resolve_reference("rtx4090") == ROOT / "profiles" / "rtx4090.json"
    with pytest.raises(OffspecError, match="not found; pass a file or one of"):
        store.resolve_reference("gtx9999")


def test_schema_file_is_the_code_schema():
    # rewrite it with: python -c "import pathlib, offspec.profile.schema as s;
    #                              s.write_json_schema(pathlib.Path('profiles/schema.json'))"
    assert json.loads((ROOT / "profiles" / "schema.json").read_text()) == json_schema()


def test_acceptance_files_load(tmp_path):
    data = measured_profile()
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    curve, source = store.load_acceptance(path)
    assert curve.budgets == (1, 2, 4) and "t / d" in source
    ref = json.loads((ROOT / "profiles" / "rtx4090.json").read_text())
    assert "acceptance" not in ref
    with pytest.raises(OffspecError, match="field acceptance is missing"):
        store.load_acceptance(ROOT / "profiles" / "rtx4090.json")
    for name in ("acceptance_prior.json", "acceptance_prior_self.json"):  # the default pair's; the self draft's
        validate(json.loads((ROOT / "offspec" / "data" / name).read_text()), name, AcceptanceFile)


def test_the_prior_curves_reach_one_largest_budget():
    # acceptance never extrapolates upward: a drafter whose prior stops early could never be planned past it
    # (the hybrid's stopped at 16 against the model's 32, so an unprofiled streamed hybrid ran smaller trees)
    for name in ("acceptance_prior.json", "acceptance_prior_self.json"):
        curves = store.acceptance_curves(json.loads((ROOT / "offspec" / "data" / name).read_text()), name)
        assert set(curves) == {"model", "suffix", "hybrid"}
        assert len({max(c.budgets) for c in curves.values()}) == 1


def test_cpu_thread_count_is_part_of_the_hardware_key(monkeypatch):
    import torch

    from offspec.profile.hardware import identity

    cpu = torch.device("cpu")
    here = identity(cpu)
    assert here["cpu_threads"] == torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: here["cpu_threads"] + 1)
    other = identity(cpu)  # e.g. the same box under OMP_NUM_THREADS: every pass costs differently
    models = {"target": "t", "draft": "d"}
    assert store.fingerprint(store.profile_key(here, models, None)) != \
        store.fingerprint(store.profile_key(other, models, None))
