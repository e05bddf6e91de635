"""`offspec plan`: projections from reference hardware profiles, clearly labelled, with their assumptions."""

import json
from pathlib import Path

import pytest

from offspec import OffspecError
from offspec.cli.profile import plan_main
from offspec.profile.auto import prior_acceptance
from offspec.profile.projection import parse_params, project, shape_of
from offspec.profile.store import load_profile

ROOT = Path(__file__).parent.parent


def test_plan_prints_a_labelled_projection_with_assumptions(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = plan_main(["--hardware", str(ROOT / "profiles" / "rtx4090.json"), "--target-params", "70B", "--quant", "nf4",
                    "--out", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("PROJECTION (computed from documented figures, not measured)")
    assert "assumptions:" in out and "acceptance curve:" in out and "chosen: --budget" in out
    assert "streamed from RAM" in out
    assert png.stat().st_size > 1000


def test_plan_json_and_offloading_favours_big_trees(capsys):
    assert plan_main(["--hardware", "rtx4090", "--target-params", "70B", "--quant", "nf4", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["projection"] is True and gpu["assumptions"]
    assert gpu["placement"]["ram_bytes"] > 0  # 39 GB of NF4 weights do not fit in 24 GB
    assert gpu["plan"]["predicted_speedup"] > 2  # streaming dominates: a big tree is almost free
    assert plan_main(["--hardware", "cpu-2core", "--target-params", "1.5B", "--draft-params", "0.5B", "--json"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cpu["placement"]["ssd_bytes"] == 0
    assert cpu["plan"]["budget"] < gpu["plan"]["budget"]  # compute-bound: small trees


def test_plan_with_a_measured_acceptance_curve(tmp_path, capsys):
    data = load_profile(ROOT / "profiles" / "cpu-2core.json")
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(data))
    assert plan_main(["--hardware", "h100-80gb", "--target-params", "405B", "--quant", "int8",
                      "--acceptance", str(path)]) == 0
    assert str(path) in capsys.readouterr().out


def test_plan_bad_input_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "hw.json"
    data = json.loads((ROOT / "profiles" / "rtx3090.json").read_text())
    data["hardware"]["device_flops"] = "lots"
    bad.write_text(json.dumps(data))
    assert plan_main(["--hardware", str(bad), "--target-params", "70B"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "hardware.device_flops" in err
    assert plan_main(["--hardware", "rtx3090", "--target-params", "seventy"]) == 2
    assert "70B" in capsys.readouterr().err


def test_projection_model_pieces():
    assert parse_params("70B") == 70e9 and parse_params("500m") == 5e8
    with pytest.raises(OffspecError):
        parse_params("12")
    assert shape_of(70e9) == (80, 8192)
    layers, hidden = shape_of(8e9)
    assert 32 <= layers <= 40 and 4096 <= hidden <= 5120
    hw = load_profile(ROOT / "profiles" / "rtx3060-12gb.json")["hardware"]
    acceptance, source = prior_acceptance()
    small = project(hw, 7e9, "nf4", 0.5e9, acceptance, source)  # 3.9 GB: resident, nothing streams
    assert small.placement["ram_bytes"] == 0 and small.placement["stream_seconds_per_pass"] == 0
    big = project(hw, 70e9, "none", 1e9, acceptance, source, ram_bytes=64e9)  # 140 GB: RAM full, SSD too
    assert big.placement["ssd_bytes"] > 0
    assert big.plan.best.tokens_per_second < small.plan.best.tokens_per_second


def test_plan_with_a_self_draft_counts_the_copy_and_says_when_it_cannot_fit(capsys):
    # a 70B Q4_K_M on a 24 GB card: its Q2_K copy alone (23 GB) leaves no room: one line, which says why
    assert plan_main(["--hardware", "rtx4090", "--target-params", "70B", "--quant", "q4_k_m",
                      "--draft-params", "self:Q2_K"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Q2_K copy of the target (the self draft) (23.0 GB)" in err
    # a 34B streams: its resident layers are the draft's own, and the draft holds its copies of the streamed ones
    assert plan_main(["--hardware", "rtx4060ti-16gb", "--target-params", "34B", "--quant", "q4_k_m",
                      "--draft-params", "self:Q2_K", "--json"]) == 0
    self_plan = json.loads(capsys.readouterr().out)
    placed = self_plan["placement"]
    copy, target = 34e9 * 84 / 256, placed["target_bytes"]
    assert placed["ram_bytes"] > 0 and placed["ram_bytes"] + placed["device_bytes"] == pytest.approx(target)
    assert placed["draft_bytes"] == pytest.approx(copy * placed["ram_bytes"] / target)  # the streamed ones' copies
    assert any("own Q2_K copy of the others" in line for line in self_plan["assumptions"])
    assert any("acceptance_prior_self" in line or "(self Q3_K)" in line for line in self_plan["assumptions"])
    assert plan_main(["--hardware", "rtx4060ti-16gb", "--target-params", "34B", "--quant", "q4_k_m", "--json"]) == 0
    model_plan = json.loads(capsys.readouterr().out)
    assert self_plan["placement"]["device_bytes"] < model_plan["placement"]["device_bytes"]  # the copies' room
    # on a 24 GB card the 34B fits whole only with the draft running its layers: the draft is the target itself
    assert plan_main(["--hardware", "rtx4090", "--target-params", "34B", "--quant", "q4_k_m",
                      "--draft-params", "self:Q2_K", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["placement"]
    assert whole["ram_bytes"] == 0 and whole["draft_bytes"] == 0
