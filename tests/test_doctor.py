"""`offspec doctor` on this CPU machine: the device, SSD and streamed-vs-resident checks run and pass, the CUDA
checks are skipped with their reason; each check's pass/fail rule, with the measurements monkeypatched."""

import json

import pytest
import torch

from offspec.cli.doctor import main
from offspec.doctor import FAIL, PASS, SKIP, checks, logits, overlap, run_checks, streaming
from offspec.errors import OffspecError

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """`offspec doctor --quick --json` on this machine."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--quick", "--json", "--offload-dir", str(tmp_path_factory.mktemp("offload"))])
    return rc, json.loads(out.getvalue())


def test_doctor_runs_on_a_cpu_machine_and_skips_what_needs_cuda_with_the_reason(cpu_report):
    rc, report = cpu_report
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert rc == 0 and report["device"] == "cpu" and report["dtype"] == "float32"
    assert status == {"device": PASS, "CUDA kernels": SKIP, "host->device copies": SKIP, "SSD read": PASS,
                      "copy/compute overlap": SKIP, "streamed == resident": PASS}
    reasons = {c["name"]: c["reason"] for c in report["checks"]}
    assert all("\n" not in r for r in reasons.values())
    assert reasons["host->device copies"].startswith("needs a CUDA GPU (")
    assert "bit for bit" in reasons["streamed == resident"] and "device/ram/ssd/ssd" in reasons["streamed == resident"]
    streamed = next(c for c in report["checks"] if c["name"] == "streamed == resident")["figures"]
    assert streamed["equal"] and streamed["max_difference"] == 0.0 and streamed["bytes_streamed"] > 0
    ssd = next(c for c in report["checks"] if c["name"] == "SSD read")["figures"]
    assert ssd["read"] > 0 and ssd["mode"] in ("direct", "buffered")


def test_the_lines_say_pass_fail_or_skip_and_a_failure_exits_1(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(checks, "disk_read_bandwidth", lambda directory, nbytes: (5e7, "buffered"))

    def broken(device, dtype):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(streaming, "compare_in_temp", broken)
    assert main(["--quick", "--offload-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("PASS  device: cpu: ")
    assert lines[1].startswith("SKIP  CUDA kernels: needs a CUDA GPU")
    assert lines[2].startswith("SKIP  host->device copies: needs a CUDA GPU")
    assert lines[3].startswith("FAIL  SSD read: 0.05 GB/s") and "below 100 MB/s" in lines[3]
    assert "refuses O_DIRECT" in lines[3]
    assert lines[5] == "FAIL  streamed == resident: RuntimeError: boom"  # one line, and the doctor went on
    assert lines[6] == "1 passed, 2 failed, 3 skipped"


def test_a_bad_device_is_one_line(capsys):
    assert main(["--device", "tpu"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown device 'tpu'; use cpu, cuda or cuda:N"


def test_the_streamed_logits_check_fails_when_they_differ(monkeypatch):
    real = logits.passes
    calls = []

    def perturbed(model):
        out = real(model)
        calls.append(1)
        return [t + 1e-3 for t in out] if len(calls) == 2 else out  # the second model: the streamed one

    monkeypatch.setattr(logits, "passes", perturbed)
    check = streaming.logits_check(CPU, torch.float32)
    assert check.status == FAIL and "differ from resident ones by up to 0.001" in check.reason


def test_overlap_is_measured_through_the_real_streamer(monkeypatch):
    closed = []
    real_close = overlap.LayerStreamer.close
    monkeypatch.setattr(overlap.LayerStreamer, "close", lambda self: (closed.append(1), real_close(self)))
    m = overlap.measure_overlap(CPU, torch.float32, 1 << 20, layers=4, passes=2, repeats=2, matmul=64)
    assert closed == [1]
    assert m["copies_timed"] == 2 * 4 - 2  # the 2 ring slots filled before each window are not counted
    assert m["copy_bandwidth"] == pytest.approx(m["copies_timed"] * (1 << 20) / m["copy_seconds"])
    assert 0.0 <= m["overlap"] <= 1.0 and m["matmuls_per_layer"] >= 1
    assert min(m["copy_seconds"], m["compute_seconds"], m["both_seconds"]) > 0


@pytest.mark.parametrize("overlap_share,bandwidth,status,says", [
    (0.95, 19e9, PASS, "95% of copy time hidden"),
    (0.30, 19e9, FAIL, "below 70%, copies and compute take turns"),
    (0.95, 15e9, FAIL, "75% of a raw pinned copy, below the 90% goal"),
])
def test_the_overlap_check_passes_only_when_copies_hide_and_stream_near_the_link(monkeypatch, overlap_share,
                                                                               bandwidth, status, says):
    figures = {"overlap": overlap_share, "copy_bandwidth": bandwidth, "copy_seconds": 0.5, "compute_seconds": 0.5,
               "both_seconds": 0.55}
    monkeypatch.setattr(streaming, "fitting_size", lambda device, nbytes: nbytes)
    monkeypatch.setattr(streaming, "measure_overlap", lambda *a, **k: figures)
    check = streaming.overlap_check(CUDA0, torch.bfloat16, 1_710_000_000, "a 70B-shaped layer", 20e9, False)
    assert check.status == status and says in check.reason and "\n" not in check.reason
    assert streaming.overlap_check(CPU, torch.float32, 1, "", None, False).status == SKIP


@pytest.mark.parametrize("pinned,pageable,status,says", [
    (24e9, 12e9, PASS, "24.0 GB/s pinned, 12.0 GB/s pageable (2.0x"),
    (6e9, 12e9, FAIL, "pinning is not working"),
    (1.5e9, 1.0e9, FAIL, "link is degraded"),
])
def test_the_copy_check_rules(monkeypatch, pinned, pageable, status, says):
    monkeypatch.setattr(checks, "host_to_device", lambda device, nbytes, repeats=3: (pinned, pageable))
    check = checks.link_check(CUDA0, 1 << 28)
    assert check.status == status and says in check.reason


def test_the_device_check_on_a_gpu(monkeypatch):
    free = [23 * 10**9]
    monkeypatch.setattr(checks, "free_memory", lambda device: (free[0], 24 * 10**9))
    monkeypatch.setattr(checks, "device_name", lambda device: "NVIDIA GeForce RTX 2080 Ti")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(checks, "default_budgets", lambda device, already=0: (21 * 10**9, 50 * 10**9))
    check = checks.device_check(CUDA0, torch.float16)
    assert check.status == PASS and "compute capability 7.5, float16;" in check.reason
    assert "--device-mem 21 GB, --ram-mem 50 GB" in check.reason
    assert "the default here is float16" in checks.device_check(CUDA0, torch.bfloat16).reason
    free[0] = 5 * 10**8
    assert checks.device_check(CUDA0, torch.float16).status == FAIL


def test_the_layer_size_is_the_models_or_a_70b_shaped_one(monkeypatch, tiny_dirs):
    target = tiny_dirs[("llama", 0)][0]
    size, what = streaming.layer_size(str(target), torch.float32, lambda e: None)
    assert what == f"the layers of {target.name}" and 4 * 64 * 64 * 4 < size < 10**6
    with pytest.raises(OffspecError):  # a model the user named must resolve
        streaming.layer_size(str(target / "missing"), torch.float32, lambda e: None)

    def not_set_up(*args, **kwargs):
        raise OffspecError("run offspec setup")

    monkeypatch.setattr(streaming, "resolve_model", not_set_up)
    size, what = streaming.layer_size(None, torch.bfloat16, lambda e: None)
    assert size == pytest.approx(1.71e9, rel=0.01) and "70B-shaped" in what and "run offspec setup" in what


def test_run_checks_reports_each_check_as_it_finishes(tmp_path):
    started, finished = [], []
    results = run_checks(CPU, torch.float32, tmp_path, quick=True, on_start=started.append, on_done=finished.append)
    assert started == [c.name for c in results] == [c.name for c in finished]
    assert len(results) == 6 and all(c.status in (PASS, SKIP) for c in results)
