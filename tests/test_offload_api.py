"""Offloading through offspec.load and the CLI on the tiny pairs: lossless speculation with a streamed target."""

import re

import pytest

import offspec
from offspec import OffspecError
from offspec.cli.main import _parser, load_options, main


@pytest.fixture(scope="module")
def deep_targets(tmp_path_factory):
    """6-layer targets for the tiny_dirs drafts (same byte tokenizer). The tiny_dirs targets have 2 layers: once
    the 2-slot ring fits, both layers fit too, so a correct placement never streams them."""
    from helpers.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("deep")
    return {arch: save_tiny_model(root / arch, arch=arch, seed=0, logit_scale=3.0, layers=6)
            for arch in ("llama", "qwen2")}


def _minimal_device_mem(target, draft, tmp_path, **options) -> str:
    """The smallest budget offspec accepts for this pair: it says so when asked for too little."""
    with pytest.raises(OffspecError) as info:
        offspec.load(str(target), str(draft), device_mem="1KB", offload_dir=str(tmp_path), **options)
    message = str(info.value)
    assert "\n" not in message and "too small" in message
    return re.search(r"--device-mem (\S+)", message)[1]


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_speculative_greedy_with_a_streamed_target_equals_plain_greedy(tiny_dirs, deep_targets, tmp_path, arch):
    target, draft = deep_targets[arch], tiny_dirs[(arch, 0)][1]
    options = dict(dtype="float64", max_context=256, max_budget=64)
    budget = _minimal_device_mem(target, draft, tmp_path, **options)
    events = []
    gen = offspec.load(str(target), str(draft), device_mem=budget, offload_dir=str(tmp_path), progress=events.append,
                       **options)
    placement = gen.info.extra["placement"]
    assert placement["layers"]["ssd"] >= 1 and placement["bytes_per_pass"] > 0
    assert placement["device_bytes"] <= placement["device_budget"]
    assert [e for e in events if e.step == "placement"][0].message.startswith("placement: ")
    assert any(e.step == "pack" and e.finished for e in events)
    assert gen.engine.target.io is not None
    in_memory = offspec.load(str(target), str(draft), **options)
    plain = in_memory.generate("Hello there", max_new_tokens=40, speculate=False)
    assert gen.generate("Hello there", max_new_tokens=40, speculate=False).token_ids == plain.token_ids
    for budget_nodes in (1, 8, 64):
        spec = gen.generate("Hello there", max_new_tokens=40, budget=budget_nodes)
        assert spec.token_ids == plain.token_ids
        streamed = [p for p in spec.passes if p.bytes_streamed > 0]
        assert len(streamed) == len(spec.passes)  # every target pass streamed the SSD layers once
        assert all(p.bytes_streamed == placement["bytes_per_pass"] for p in spec.passes)
        assert all(0.0 <= p.io_wait_seconds <= p.target_seconds + 1e-3 for p in spec.passes)
        assert all(p.stream_bandwidth == p.bytes_streamed / p.target_seconds for p in spec.passes)
        summary = spec.summary()  # what `offspec generate --json` prints
        assert summary["bytes_streamed"] == placement["bytes_per_pass"] * len(spec.passes)
        assert [row["bytes_streamed"] for row in summary["per_pass"]] == [p.bytes_streamed for p in spec.passes]
        assert all(row["stream_gb_per_s"] > 0 and row["io_wait_seconds"] >= 0 for row in summary["per_pass"])


def test_quantized_target_and_draft_stay_lossless_with_respect_to_the_quantized_target(tiny_dirs, deep_targets,
                                                                                       tmp_path):
    target, draft = deep_targets["qwen2"], tiny_dirs[("qwen2", 1)][1]
    options = dict(dtype="float32", max_context=256, max_budget=64, offload_dir=str(tmp_path))
    with pytest.raises(OffspecError, match="--quant nf4 needs a CUDA GPU"):  # bitsandbytes NF4 is slow on a CPU
        offspec.load(str(target), str(draft), quant="nf4", **options)
    gen = offspec.load(str(target), str(draft), quant="int4", draft_quant="int8", ram_mem="64MB", **options)
    assert gen.info.extra["placement"]["quant"] == "int4"
    plain = gen.generate("abc", max_new_tokens=30, speculate=False)
    assert gen.generate("abc", max_new_tokens=30, budget=16).token_ids == plain.token_ids


def test_default_budgets_keep_a_small_model_resident(tiny_dirs):
    target, draft = tiny_dirs[("llama", 1)]
    gen = offspec.load(str(target), str(draft), max_context=128, max_budget=16, budget=8)
    placement = gen.info.extra["placement"]
    assert placement["layers"] == {"device": 2, "ram": 0, "ssd": 0}
    assert placement["budget_source"] == "free memory" and placement["packed_dir"] is None
    assert gen.engine.target.io is None


def test_bad_sizes_and_budgets_are_one_line_errors(tiny_dirs, tmp_path, capsys):
    target, draft = tiny_dirs[("llama", 0)]
    with pytest.raises(OffspecError, match="cannot read device_mem '12XB'"):
        offspec.load(str(target), str(draft), device_mem="12XB")
    with pytest.raises(OffspecError, match="ram_mem"):
        offspec.load(str(target), str(draft), ram_mem="lots")
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--device-mem", "12XB", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: cannot read device_mem '12XB'") and err.count("\n") == 1
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--device-mem", "2KB",
               "--offload-dir", str(tmp_path), "hi"])
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]  # after the progress bars
    assert rc == 2 and last.startswith("error: device memory budget 2 KB is too small") and "--device-mem" in last


def test_cli_offload_flags_become_load_options():
    args = _parser().parse_args(["generate", "--device-mem", "22GB", "--ram-mem", "64GiB", "--quant", "nf4",
                                 "--draft-quant", "int8", "--offload-dir", "/x", "hi"])
    options = load_options(args)
    assert options["device_mem"] == "22GB" and options["ram_mem"] == "64GiB" and options["quant"] == "nf4"
    assert options["draft_quant"] == "int8" and options["offload_dir"] == "/x"
    assert "device_mem" not in load_options(_parser().parse_args(["generate", "hi"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "--quant", "int3", "hi"])


def test_bench_with_a_streamed_target_counts_bytes_and_stays_lossless(tiny_dirs, deep_targets, tmp_path):
    from offspec.cli.bench import parse_setups, run_bench
    from offspec.config import TreeConfig

    target, draft = deep_targets["llama"], tiny_dirs[("llama", 0)][1]
    options = dict(dtype="float64", max_context=256, max_budget=64)
    budget = _minimal_device_mem(target, draft, tmp_path, **options)
    gen = offspec.load(str(target), str(draft), device_mem=budget, offload_dir=str(tmp_path), budget=8, **options)
    per_pass = gen.info.extra["placement"]["bytes_per_pass"]
    report = run_bench(gen, ["Hello there", "abc"], parse_setups("ar,hf,8", TreeConfig()), max_new_tokens=12,
                       temperature=0.0, out_dir=tmp_path / "bench")
    ar, hf, tree = (report["setups"][name] for name in ("ar", "hf-assisted", "tree8"))
    # transformers' generate over the hooks; float64 attends with SDPA on both sides (exact attention is float32)
    assert hf["outputs_unlike_ar"] == 0 and tree["greedy_mismatches"] == 0
    for s in (ar, tree):
        assert s["bytes_streamed_per_pass"] == per_pass and s["stream_bandwidth"] > 0
    assert hf["stream_bandwidth"] == 0.0  # not counted outside offspec's engine
    # the raw disk read, before and after the prompts, beside the table
    assert [c["at_prompt"] for c in report["disk_checks"]] == [0, 2]
    assert all(c["ssd_read"] > 0 and c["ssd_read_bytes"] > 0 for c in report["disk_checks"])
    assert "Raw read of the streamed layer files" in (tmp_path / "bench" / "bench.md").read_text()


def test_close_releases_a_streamed_targets_buffers_and_later_use_is_one_line(tiny_dirs, deep_targets, tmp_path):
    import gc
    import weakref

    target, draft = deep_targets["llama"], tiny_dirs[("llama", 0)][1]
    options = dict(dtype="float32", max_context=128, max_budget=16, budget=4)
    budget = _minimal_device_mem(target, draft, tmp_path, **options)
    gen = offspec.load(str(target), str(draft), device_mem=budget, ram_mem="1MB", offload_dir=str(tmp_path),
                       **options)
    streamer = gen.engine.target.io
    held = [weakref.ref(t.untyped_storage()) for t in streamer._p.staging + streamer._p.slots]
    held += [weakref.ref(s.ram.untyped_storage()) for s in streamer._p.order if s.ram is not None]
    assert len(held) > 4
    gen.close()
    gc.collect()
    assert all(ref() is None for ref in held)  # slots, staging buffers and RAM copies are gone (unpinned on CUDA)
    with pytest.raises(OffspecError, match="the layer streamer was closed; load the model again"):
        gen.generate("Hello", max_new_tokens=4)
