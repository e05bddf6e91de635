"""`offspec bench offload` on a tiny model: it runs end to end and writes its JSON and plot (not a benchmark)."""

import json

import pytest

from offspec.cli.bench_offload import main

pytestmark = pytest.mark.slow  # a whole `offspec bench offload` run (test_offload_api's bench test is the quick one)


def test_bench_offload_writes_json_and_plot(tiny_dirs, tmp_path, capsys, monkeypatch):
    from helpers.tiny import save_tiny_model

    import offspec.cli.bench_offload as bench
    import offspec.offload.materialize as materialize

    streamers, closed_when_accelerate_loads = [], []

    class Recorded(materialize.LayerStreamer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            streamers.append(self)

    def accelerate_model(*args, **kwargs):  # offspec's streamer (pinned buffers on CUDA) must be gone by now
        closed_when_accelerate_loads.append([s.closed and s._p.staging == [] for s in streamers])
        return real_accelerate_model(*args, **kwargs)

    real_accelerate_model = bench.accelerate_model
    monkeypatch.setattr(materialize, "LayerStreamer", Recorded)
    monkeypatch.setattr(bench, "accelerate_model", accelerate_model)

    target = save_tiny_model(tmp_path / "target", layers=6, hidden=256)  # 2.4 MB per layer
    out = tmp_path / "out"
    common = ["--target", str(target), "--tokens", "1,8", "--repeat", "1", "--offload-dir", str(tmp_path / "packed"),
              "--out", str(out)]
    assert main(common + ["--device-mem", "1KB"]) == 2  # too small: the message names the smallest budget
    budget = capsys.readouterr().err.split("--device-mem ")[1].split()[0]
    rc = main(common + ["--device-mem", budget])
    assert rc == 0
    report = json.loads((out / "offload-bench.json").read_text())
    assert (out / "offload-bench.png").stat().st_size > 1000
    assert report["placement"]["layers"]["ssd"] >= 1 and report["raw_link"].startswith("SSD -> RAM read")
    assert [r["tokens"] for r in report["offspec"]] == [1, 8] == [r["tokens"] for r in report["accelerate"]]
    assert all(r["bytes_streamed"] == report["placement"]["bytes_per_pass"] for r in report["offspec"])
    assert set(report["ratio_accelerate_over_offspec"]) == {"1", "8"}
    assert "| tokens |" in capsys.readouterr().out
    assert closed_when_accelerate_loads == [[True]]
    assert main(["--target", str(target), "--device-mem", "12XB", "--out", str(out)]) == 2
