"""scripts/gpu_check.py's bookkeeping without a GPU: the JSON keys issue 33 lists, the lossless verdict read from
a junit file, the projection from measured kernel efficiencies, and the shape twins' sizes. The measurements run on
a GPU only (scripts/gpu_check.sh)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
gpu_check = pytest.importorskip("gpu_check")  # imports Triton's modules (present or not: they guard themselves)

ISSUE_KEYS = {"device", "q4k_1row_bandwidth_fraction", "q4k_64row_vs_bf16", "draft_step_ms", "slice_pass_vs_link",
              "slice_1024_vs_1", "target_alone_tok_s", "lossless_bf16", "projection_4090_70b_tok_s"}


def test_the_report_has_exactly_the_issues_keys_and_says_what_it_skipped(tmp_path):
    r = gpu_check.Report(deadline=0.0, warm=False)  # the deadline is spent: every section is skipped, and says so
    assert set(r.values) == ISSUE_KEYS and all(v is None for v in r.values.values())
    r.section("Kernel table", lambda report: "never run")
    assert r.sections == [("Kernel table", "skipped: the time budget was spent before it")]
    text = gpu_check.markdown(r)
    assert "## Kernel table" in text and json.loads(text.split("```json")[1].split("```")[0]) == r.values


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
