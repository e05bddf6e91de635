"""scripts/gpu_check.py's bookkeeping without a GPU: the JSON keys issues 33 and 39 list, a failed section as one line
(its keys null), the lossless verdict and the failures read from junit files, the projection from measured kernel
efficiencies, the end-to-end parsing (scripts/gpu_e2e.py) and transformers' peer on tiny shapes, and the shape
twins' sizes. The measurements run on a GPU only (scripts/gpu_check.sh)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
gpu_check = pytest.importorskip("gpu_check")  # imports Triton's modules (present or not: they guard themselves)
import gpu_e2e  # noqa: E402

ISSUE_KEYS = {"device", "q4k_1row_bandwidth_fraction", "q4k_64row_vs_bf16", "draft_step_ms", "slice_pass_vs_link",
              "slice_1024_vs_1", "target_alone_tok_s", "lossless_bf16", "projection_4090_70b_tok_s",
              "pytest_cuda_failed", "e2e_ar_tok_s", "e2e_vs_transformers", "e2e_tree64_pass_vs_ar_pass",
              "e2e_streamed_pass_vs_link", "e2e_greedy_mismatches"}


def test_the_report_has_exactly_the_issues_keys_and_says_what_it_skipped(tmp_path):
    r = gpu_check.Report(deadline=0.0, warm=False)  # the deadline is spent: every section is skipped, and says so
    assert set(r.values) == ISSUE_KEYS and all(v is None for v in r.values.values())
    r.section("Kernel table", lambda report: "never run")
    assert r.sections == [("Kernel table", "skipped: the time budget was spent before it")]
    text = gpu_check.markdown(r)
    assert "## Kernel table" in text and json.loads(text.split("```json")[1].split("```")[0]) == r.json()
    assert set(r.json()) == ISSUE_KEYS | {"errors"} and "Kernel table" in r.json()["errors"]


def test_a_failed_section_leaves_its_keys_null_and_says_why_in_one_line(tmp_path, capsys):
    r = gpu_check.Report(deadline=1e18, warm=False, trace_log=tmp_path / "errors.log")

    def broken(report):
        report.values["e2e_ar_tok_s"] = None
        raise RuntimeError("CUDA error: an illegal memory access\nsecond line")

    r.section("End to end", broken)
    r.section("Fine", lambda report: "ok")
    assert r.json()["errors"] == {"End to end": "RuntimeError: CUDA error: an illegal memory access"}
    assert r.sections[0][1].startswith("failed: RuntimeError: CUDA error") and "Traceback" not in gpu_check.markdown(r)
    assert "Traceback" in (tmp_path / "errors.log").read_text()  # for whoever debugs it, not in the report
    out = capsys.readouterr().out
    assert "Traceback" not in out and "End to end" in out and "Fine" in out


def test_pytest_failures_count_failures_and_errors_of_every_run(tmp_path):
    def junit(name, failures, errors):
        path = tmp_path / name
        path.write_text(f'<?xml version="1.0"?><testsuites><testsuite failures="{failures}" errors="{errors}" '
                        f'tests="9"></testsuite></testsuites>')
        return path

    assert gpu_e2e.pytest_failures([junit("a.xml", 2, 1), junit("b.xml", 0, 0)]) == 3
    with pytest.raises(gpu_e2e.SectionError, match="no c.xml: its pytest run did not finish"):
        gpu_e2e.pytest_failures([junit("a.xml", 0, 0), tmp_path / "c.xml"])


def test_the_bench_keys_come_from_bench_json():
    def setup(tok_s, per_pass, mismatches=None):
        s = {"tokens_per_second": tok_s, "target_seconds_per_pass": per_pass}
        return s if mismatches is None else dict(s, greedy_mismatches=mismatches)

    report = {"setups": {"ar": setup(120.0, 0.008), "16": setup(150.0, 0.009, 0), "64": setup(160.0, 0.010, 1),
                         "256": setup(90.0, 0.02, 0), "1024": setup(40.0, 0.05, 2)}}
    assert gpu_e2e.bench_keys(report) == {"e2e_ar_tok_s": 120.0, "e2e_tree64_pass_vs_ar_pass": 1.25,
                                          "e2e_greedy_mismatches": 3}
    del report["setups"]["1024"]
    with pytest.raises(gpu_e2e.SectionError, match="lacks tree set-ups"):
        gpu_e2e.bench_keys(report)
    cmd = gpu_e2e.bench_command(Path("/t"), Path("/o"))
    assert cmd[cmd.index("--budgets") + 1] == "ar,16,64,256,1024" and "/t/t.gguf" in cmd and "/t/d.gguf" in cmd


def test_the_streamed_ratio_is_the_worst_pass_up_to_64_tokens_over_the_link():
    rows = [{"tokens": 1, "seconds": 0.030}, {"tokens": 16, "seconds": 0.033}, {"tokens": 64, "seconds": 0.036},
            {"tokens": 256, "seconds": 0.09}]
    assert gpu_e2e.streamed_vs_link({"stream_bound_seconds": 0.030, "offspec": rows}) == 1.2
    with pytest.raises(gpu_e2e.SectionError, match="nothing streamed"):
        gpu_e2e.streamed_vs_link({"stream_bound_seconds": None, "offspec": rows, "placement": {}})
    assert "--no-accelerate" in gpu_e2e.offload_command(Path("t.gguf"), "900MB", Path("o"))
    assert gpu_e2e.ratio(150.0, 25.0) == 6.0 and gpu_e2e.ratio(None, 25.0) is None


def test_transformers_peer_is_made_on_the_device_in_bfloat16_and_generates():
    model = gpu_e2e.peer_model(torch.device("cpu"), 64, 128, 2, 4, 2, 300)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32  # put back
    assert gpu_e2e.peer_tok_s(model, prompt_tokens=8, new_tokens=4, runs=1) > 0


def test_a_failed_command_is_one_line(tmp_path):
    log = tmp_path / "x.log"
    with pytest.raises(gpu_e2e.SectionError) as info:
        gpu_e2e.run([sys.executable, "-c", "import sys; print('step 1'); sys.exit('error: the twins are gone')"],
                    60, log)
    assert "\n" not in str(info.value) and str(info.value).endswith("exited 1: error: the twins are gone")
    assert "step 1" in log.read_text()
    with pytest.raises(gpu_e2e.SectionError, match="no bench.json: error: the twins are gone"):
        gpu_e2e.read_json(tmp_path / "bench.json", log)


def test_lossless_is_true_only_when_every_lossless_test_ran_and_passed(tmp_path):
    def junit(*cases):
        body = "".join(f'<testcase classname="tests.test_cuda_layer" name="{name}">{inner}</testcase>'
                       for name, inner in cases)
        path = tmp_path / "cuda.xml"
        path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')
        return path

    name = "test_greedy_speculation_equals_the_target_alone_in_bfloat16"
    r = gpu_check.Report(deadline=1e18, warm=False)
    gpu_check.lossless(r, junit((f"{name}[False]", ""), (f"{name}[True]", ""), ("test_other", "<failure/>")))
    assert r.values["lossless_bf16"] is True
    gpu_check.lossless(r, junit((f"{name}[False]", ""), (f"{name}[True]", '<failure message="x"/>')))
    assert r.values["lossless_bf16"] is False
    gpu_check.lossless(r, junit((f"{name}[False]", '<skipped message="no GPU"/>'),))
    assert r.values["lossless_bf16"] is False  # skipped is not lossless
    gpu_check.lossless(r, junit(("test_other", "")))
    assert r.values["lossless_bf16"] is False  # not run at all


def test_the_projection_takes_this_runs_kernel_efficiencies():
    r = gpu_check.Report(deadline=1e18, warm=False)
    text = gpu_check.projection(r)  # no measurements: the projection's own assumptions
    default = r.values["projection_4090_70b_tok_s"]
    assert default > 0 and "tok/s" in text
    r.values.update(q4k_1row_bandwidth_fraction=0.3, q4k_64row_vs_bf16=3.0)  # slow kernels: a slower projection
    gpu_check.projection(r)
    assert 0 < r.values["projection_4090_70b_tok_s"] < default


def test_the_twins_have_the_models_shapes():
    from gpu_twins import SHAPES

    llama = SHAPES["70b"]
    assert (llama.hidden, llama.inter, llama.heads, llama.kv_heads, llama.vocab) == (8192, 28672, 64, 8, 128256)
    assert 530e6 < llama.layer_bytes() < 560e6  # a Q4_K_M layer of Llama-3-70B: about 0.55 GB
    assert SHAPES["1.5b"].layers == 28 and SHAPES["0.5b"].layers == 24
    for shape in SHAPES.values():  # every weight's rows are whole blocks of its type
        assert shape.layer_bytes() > 0
