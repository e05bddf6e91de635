"""`offspec profile --quick` on tiny random models, and `budget="auto"` picking profiles up at load."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import offspec
from offspec import OffspecError
from offspec.cli.profile import profile_main
from offspec.profile.store import acceptance_curves, find_profile, fingerprint, load_profile, save_profile

ROOT = Path(__file__).parent.parent
# a profile is keyed by the thread count; "auto" sizes it to the cores other processes leave free, which on a
# busy test machine can differ between the profile and a later load (the profile would then not match)
THREADS = 1


@pytest.fixture()
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture(scope="module")
def quick_profile(tiny_dirs, tmp_path_factory):
    """One `offspec profile --quick` run on the tiny qwen2 pair, into its own config dir."""
    root = tmp_path_factory.mktemp("quick")
    target, draft = tiny_dirs[("qwen2", 1)]
    mp = pytest.MonkeyPatch()
    mp.setenv("OFFSPEC_CONFIG_DIR", str(root / "config"))
    try:
        rc = profile_main(["--target", str(target), "--draft", str(draft), "--quick", "--max-context", "512",
                           "--threads", str(THREADS),
                           "--out", str(root / "quick.json")])
    finally:
        mp.undo()
    return rc, root


def test_quick_profile_completes_with_every_section(quick_profile, capsys):
    rc, root = quick_profile
    assert rc == 0
    saved = list((root / "config" / "profiles").glob("*.json"))
    assert len(saved) == 1 and (root / "quick.json").is_file() and (root / "quick.png").stat().st_size > 1000
    data = load_profile(saved[0])  # valid against the schema
    assert data == load_profile(root / "quick.json")
    assert data["kind"] == "measured" and data["quick"] is True
    assert saved[0].stem == data["fingerprint"]
    hw = data["hardware"]
    assert hw["device_type"] == "cpu" and hw["host_ram_bytes"] > 0 and hw["disk_read_bytes_per_s"] > 0
    t = data["timings"]
    assert [n for n, _ in t["target_pass"]][:3] == [1, 2, 4] and len(t["target_pass"]) >= 3
    assert [n for n, _ in t["draft_step"]][:2] == [1, 2] and t["target_head_seconds"] > 0
    acc = data["acceptance"]
    assert acc["budgets"][0] == 1 and max(acc["budgets"]) >= 16 and acc["prompts"] == 4 and acc["passes"] >= 4
    assert all(a <= b for a, b in zip(acc["accepted"], acc["accepted"][1:]))
    assert all(len(s) == len(acc["budgets"]) for s in acc["samples"])
    assert data["plan"]["budget"] in [b for b in range(1, 4097)]
    assert data["plan"]["predicted_tokens_per_second"] > 0


def test_auto_budget_uses_the_matching_profile(quick_profile, tiny_dirs, monkeypatch):
    _, root = quick_profile
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(root / "config"))
    target, draft = tiny_dirs[("qwen2", 1)]
    gen = offspec.load(str(target), str(draft), max_context=512, threads=THREADS)  # no budget: auto
    data = load_profile(next((root / "config" / "profiles").glob("*.json")))
    assert gen.info.extra["budget_source"] == "profile"
    assert "measured profile" in gen.info.extra["budget_basis"]
    assert gen.tree.budget == data["plan"]["budget"] == gen.info.default_budget
    assert gen.tree.max_beams == data["plan"]["max_beams"] and gen.tree.max_depth == data["plan"]["max_depth"]
    # timing drift and the measured guard re-plan on this busy test machine at will: they have their own tests
    # (test_profile_adapt.py); here every pass must follow the profile's plan
    gen.policy.config = replace(gen.policy.config, time_tolerance=math.inf)
    gen.policy.guard = None
    result = gen.generate("Hello", max_new_tokens=24)
    # the tiny pair's measured plan may predict that no tree pays off; the default (hybrid) policy then gates
    # suffix candidates pass by pass: up to confident_budget of them, cut to what pays
    speculates = data["plan"]["speculate"]
    assert gen.policy.speculates == speculates and gen.policy.gated == (not speculates)
    unplanned = gen.tree.confident_budget  # the gated passes' budget
    assert result.passes[0].budget == (data["plan"]["budget"] if speculates else unplanned)
    # the policy saw every tree pass; where the plan is a hybrid tree (CI's busy machine measured one at a predicted
    # 1.003x), a pass that chose the suffix candidates alone counts as gated, and a confident copy beyond the budget
    # as neither (AdaptiveBudget.observe)
    alone = sum(p.drafter == "suffix" for p in result.passes) if gen.policy.choosing else 0
    beyond = sum(p.tree_size > p.budget > 0 and not (gen.policy.choosing and p.drafter == "suffix")
                 for p in result.passes)
    assert gen.policy.passes == (result.n_passes - alone - beyond if speculates else 0)
    assert gen.policy.gated_passes == (alone if speculates else result.n_passes)
    assert speculates or {p.drafter for p in result.passes} == {"suffix"}
    assert gen.info.extra["budget_adaptive"]["passes_observed"] == gen.policy.passes
    # an explicit per-call budget, or a tree assigned by a caller (bench), bypasses the policy
    assert all(p.budget == 3 for p in gen.generate("Hello", max_new_tokens=8, budget=3).passes)
    saved = gen.tree
    gen.tree = offspec.TreeConfig(budget=5)
    assert all(p.budget == 5 for p in gen.generate("Hello", max_new_tokens=8).passes)
    gen.tree = saved
    assert gen.generate("Hello", max_new_tokens=8).passes[0].budget == (gen.policy.plan.best.budget if speculates
                                                                        else unplanned)


def test_auto_budget_says_when_the_profile_was_measured_with_other_cpu_kernels(quick_profile, tiny_dirs, tmp_path,
                                                                            monkeypatch):
    """A kernel change makes a profile's timings stale: it is not used, and the load says why and what to do."""
    _, root = quick_profile
    data = load_profile(next((root / "config" / "profiles").glob("*.json")))
    assert data["key"]["models"]["kernels"] in ("torch",) or data["key"]["models"]["kernels"].startswith("compiled ")
    data["key"]["models"]["kernels"] = "compiled 000000000000"  # measured with an older build
    data["fingerprint"] = fingerprint(data["key"])
    stale = save_profile(data, tmp_path / "config" / "profiles" / f"{data['fingerprint']}.json")
    other = dict(data, key={**data["key"], "models": {**data["key"]["models"], "target": "another model"}})
    other["fingerprint"] = fingerprint(other["key"])
    save_profile(other, tmp_path / "config" / "profiles" / f"{other['fingerprint']}.json")  # not this pair: not named
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    target, draft = tiny_dirs[("qwen2", 1)]
    events = []
    gen = offspec.load(str(target), str(draft), max_context=512, threads=THREADS, progress=events.append)
    extra = gen.info.extra
    assert extra["budget_source"] == "estimate"
    assert f"profile {stale} was measured with another build of offspec's CPU kernels" in extra["budget_basis"]
    notes = [e.message for e in events if e.step == "stale-profile"]
    assert len(notes) == 1 and str(stale) in notes[0] and "run `offspec profile`" in notes[0]


def test_auto_budget_takes_the_pairs_acceptance_from_a_profile_of_another_placement(quick_profile, tiny_dirs,
                                                                                      tmp_path, monkeypatch):
    """`offspec profile` at one placement, then a load at another (here the profile re-keyed as streamed): timings are
    estimated at start-up, acceptance is the profile's (measured for this pair), and the basis says both."""
    _, root = quick_profile
    data = load_profile(next((root / "config" / "profiles").glob("*.json")))
    streamed = {"device": "cpu", "layers": {"device": 0, "ram": 0, "ssd": 2}, "quant": "none", "tiers": ["ssd", "ssd"]}
    assert data["key"]["placement"] != streamed
    data["key"]["placement"] = streamed
    data["fingerprint"] = fingerprint(data["key"])
    other = save_profile(data, tmp_path / "config" / "profiles" / f"{data['fingerprint']}.json")
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    target, draft = tiny_dirs[("qwen2", 1)]
    gen = offspec.load(str(target), str(draft), max_context=512, threads=THREADS)
    extra = gen.info.extra
    assert extra["budget_source"] == "estimate" and "start-up estimate" in extra["budget_basis"]
    assert f"acceptance measured in profile {other}" in extra["budget_basis"]
    assert "timings not used" in extra["budget_basis"]
    measured = acceptance_curves(data, str(other))
    for mode, policy in gen.policies.items():
        assert policy.acceptance == measured[mode], mode
    # damaged (its key readable, its acceptance not), it is named with what is wrong and the prior is used instead
    other.write_text(json.dumps(dict(data, acceptance=dict(data["acceptance"], accepted="many"))))
    gen = offspec.load(str(target), str(draft), max_context=512, threads=THREADS)
    basis = gen.info.extra["budget_basis"]
    assert "acceptance: prior curves measured with" in basis and "acceptance.accepted" in basis and str(other) in basis
    assert all(policy.acceptance != measured[mode] for mode, policy in gen.policies.items())


def test_auto_budget_without_profile_estimates_at_start_up(tiny_dirs, config_dir):
    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), max_context=256, max_budget=64)
    extra = gen.info.extra
    assert extra["budget_source"] == "estimate"
    assert "start-up estimate" in extra["budget_basis"] and "target passes timed" in extra["budget_basis"]
    assert "draft trees of 1: " in extra["budget_basis"]  # whole-tree growth timed, from a budget of 1
    assert 1 <= gen.tree.budget <= 64 and gen.policy is not None
    plain = gen.generate("Hi", max_new_tokens=16, speculate=False)
    assert gen.generate("Hi", max_new_tokens=16).token_ids == plain.token_ids  # still lossless
    assert gen.engine.tokens  # the estimate left no stale state: generation worked from a clean cache


def test_fixed_budget_has_no_policy(tiny_dirs, config_dir):
    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), max_context=256, budget=8)
    assert gen.policy is None and gen.info.extra["budget_source"] == "fixed" and gen.tree.budget == 8
    auto = offspec.load(str(target), str(draft), max_context=256, budget="auto", max_budget=16)
    assert auto.policy is not None and auto.tree.budget <= 16
    with pytest.raises(OffspecError, match="budget must be a positive integer or auto"):
        offspec.load(str(target), str(draft), budget="big")


def test_malformed_saved_profile_is_a_clear_error(quick_profile, tiny_dirs, tmp_path, monkeypatch):
    _, root = quick_profile
    source = next((root / "config" / "profiles").glob("*.json"))
    data = json.loads(source.read_text())
    data["timings"]["target_pass"] = "fast"
    broken = tmp_path / "config" / "profiles" / source.name
    broken.parent.mkdir(parents=True)
    broken.write_text(json.dumps(data))
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    target, draft = tiny_dirs[("qwen2", 1)]
    with pytest.raises(OffspecError, match=r"timings.target_pass: expected an array") as info:
        offspec.load(str(target), str(draft), max_context=512, threads=THREADS)
    assert str(broken) in str(info.value)
    assert find_profile(data["key"]) == broken


@pytest.mark.slow
def test_cli_budget_flag_accepts_auto(tiny_dirs, tmp_path):
    target, draft = tiny_dirs[("qwen2", 0)]
    env = {**__import__("os").environ, "OFFSPEC_CONFIG_DIR": str(tmp_path)}
    base = [sys.executable, str(ROOT / "main.py"), "generate", "--target", str(target), "--draft", str(draft),
            "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(base + ["--budget", "auto", "Hi"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passes"] >= 1
    bad = subprocess.run(base + ["--budget", "lots", "Hi"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "auto or a positive integer" in bad.stderr and "Traceback" not in bad.stderr


def test_tree_growth_timing_stops_at_the_first_budget_not_worth_it(tiny_dirs, config_dir):
    from offspec.profile.measure import calibration_prompts, measure_propose

    target, draft = tiny_dirs[("llama", 0)]
    gen = offspec.load(str(target), str(draft), max_context=256, budget=8)
    seen = []
    rows = measure_propose(gen, [1, 2, 4, 8, 16], calibration_prompts(2),
                           worth=lambda b, s: (seen.append(b), b < 4)[1])
    assert [b for b, _ in rows] == [1, 2] and all(s > 0 for _, s in rows)
    assert seen == [1, 2, 4]  # nothing past the first budget not worth it is timed, on any context
