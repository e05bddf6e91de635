"""CUDA-only checks (`pytest -m cuda`): the doctor's checks as tests, the pinned ring, multi-slot reuse under
load, ordered first fills, out-of-memory handling, cuda:N, and lossless speculation with a streamed target on
the GPU. On a machine without CUDA every test here is skipped, and the reason shows in the summary (-ra).
"""

import gc
import re
from dataclasses import replace

import pytest
import torch
from helpers.gpu_device import GPU, cuda_marks

import offspec
from offspec import OffspecError

pytestmark = cuda_marks()


def _dtype():
    from offspec.util.device import default_dtype

    return default_dtype(GPU)


# --- the doctor's checks -------------------------------------------------------------------------
def test_device_check_and_default_dtype():
    from offspec.doctor.checks import PASS, device_check

    check = device_check(GPU, _dtype())
    assert check.status == PASS, check.line()
    major, _ = torch.cuda.get_device_capability(GPU)
    assert _dtype() == (torch.bfloat16 if major >= 8 else torch.float16)


def test_pinned_copies_beat_pageable_ones():
    from offspec.doctor.checks import PASS, link_check

    check = link_check(GPU, 256 * 2**20)
    assert check.status == PASS, check.line()


def test_ssd_read_check(tmp_path):
    from offspec.doctor.checks import PASS, disk_check

    check = disk_check(tmp_path, 256 * 2**20)
    assert check.status == PASS, check.line()


def test_the_copy_stream_overlaps_compute_and_streams_near_the_link():
    from offspec.doctor.checks import link_check
    from offspec.doctor.streaming import overlap_check

    pinned = link_check(GPU, 256 * 2**20).figures["pinned"]
    check = overlap_check(GPU, _dtype(), 256 * 2**20, "256 MiB test layers", pinned, quick=True)
    print(check.line())  # the figures, for the README table (pytest -s)
    assert check.status == "pass", check.line()


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_streamed_logits_equal_resident_logits(dtype):
    from offspec.doctor.streaming import logits_check

    check = logits_check(GPU, dtype or _dtype())
    assert check.status == "pass", check.line()


def test_doctor_command_passes(tmp_path, capsys):
    from offspec.cli.doctor import main

    rc = main(["--quick", "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "SKIP" not in out


# --- pinned memory -------------------------------------------------------------------------------
def test_host_buffers_are_pinned_for_real_exactly_sized_and_unpinned_when_gone():
    from offspec.offload.hostmem import host_buffer, page_round, pinned_bytes

    before = pinned_bytes()
    buf = host_buffer(10_000_000, pin=True, device=GPU)
    assert buf.is_pinned() and buf.untyped_storage().nbytes() == page_round(10_000_000)
    assert pinned_bytes() == before + page_round(10_000_000)
    view = buf[4096:]
    del buf
    gc.collect()
    assert view.is_pinned() and pinned_bytes() > before
    dst = torch.empty(view.numel(), dtype=torch.uint8, device=GPU)
    dst.copy_(view.fill_(3), non_blocking=True)  # a DMA from registered memory
    torch.cuda.current_stream(GPU).synchronize()
    assert int(dst.min()) == int(dst.max()) == 3
    del view
    gc.collect()
    assert pinned_bytes() == before


def _layers(n, nbytes):
    """n distinct payloads of nbytes: layer i is the float32 value i + 1 everywhere."""
    return [torch.full((nbytes // 4,), float(i + 1)).view(torch.uint8) for i in range(n)]


@pytest.mark.parametrize("ring_slots", [2, 3])
def test_ring_slots_are_never_refilled_under_compute_that_still_reads_them(tmp_path, ring_slots):
    """The host queues slow compute that reads each slot and runs far ahead of the GPU; the copier refills slots
    as soon as they are released. Every layer's compute must still see its own bytes (sums checked at the end)."""
    from offspec.offload.diskio import aligned_empty
    from offspec.offload.streamer import LayerSource, LayerStreamer
    from offspec.store.packed import build_store, plan_layer

    n, nbytes = 8, 8 * 2**20
    payloads = _layers(n, nbytes)
    plans = [plan_layer(i, [("w", torch.uint8, (nbytes,))]) for i in range(n)]
    packed = build_store(tmp_path / "s", {}, plans, lambda i: [("w", payloads[i])], lambda e: None, "p", "p")
    sources = []
    for i in range(n):
        if i % 2:  # RAM tier: pinned host copies
            ram = aligned_empty(nbytes, pin=True, device=GPU).copy_(payloads[i])
            assert ram.is_pinned()
            sources.append(LayerSource(i, packed.layers[i], ram=ram))
        else:  # SSD tier: O_DIRECT into pinned staging buffers
            sources.append(LayerSource(i, packed.layers[i], path=packed.path(i)))
    streamer = LayerStreamer(GPU, sources, ring_slots=ring_slots, staging_buffers=2, set_id=packed.set_id)
    assert all(s.is_pinned() for s in streamer._p.staging)
    big = torch.randn(2048, 2048, device=GPU)  # (2048, 2048) slow compute queued before each read
    sums = []
    for _ in range(4):
        for i in range(n):
            slot = streamer.acquire(i)
            for _ in range(8):
                torch.mm(big, big)
            sums.append(slot[:nbytes].view(torch.float32).sum())  # queued; read when the compute gets there
            streamer.release(i)
    got = torch.stack(sums).cpu()  # one sync, at the end
    want = torch.tensor([float(i + 1) * nbytes / 4 for _ in range(4) for i in range(n)])
    assert torch.equal(got, want)
    streamer.close()
    assert streamer._p.streams.copy_stream.query()  # drained


def test_a_slots_first_fill_waits_for_compute_queued_before_the_ring_was_allocated():
    """Memory freed under queued compute goes back to the allocator at once; the ring may get it. The first copy
    into it must wait for that compute, or the queued sum reads the layer's bytes instead of its own."""
    from offspec.offload.diskio import aligned_empty
    from offspec.offload.streamer import LayerSource, LayerStreamer
    from offspec.store.packed import plan_layer

    nbytes = 64 * 2**20
    big = torch.randn(4096, 4096, device=GPU)
    for _ in range(3):
        a = torch.ones(nbytes // 4, device=GPU)  # (nbytes / 4,) float32
        for _ in range(20):
            torch.mm(big, big)  # slow work queued before the sum
        total = a.sum()  # queued: reads `a`
        del a  # its memory may go to the ring right away
        spec = plan_layer(0, [("w", torch.uint8, (nbytes,))])
        ram = aligned_empty(nbytes, pin=True, device=GPU).copy_(_layers(1, nbytes)[0] * 0 + 7)
        sources = [LayerSource(0, spec, ram=ram), LayerSource(1, replace(spec, index=1), ram=ram)]
        streamer = LayerStreamer(GPU, sources, ring_slots=2)
        assert float(total) == nbytes // 4
        streamer.close()


# --- out of memory, budgets ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("cuda-pair")
    target = save_tiny_model(root / "target", seed=0, logit_scale=3.0, layers=6)
    draft = save_tiny_model(root / "draft", seed=0, logit_scale=3.0, noise=0.02)
    return target, draft


def test_device_mem_above_what_is_free_is_refused_in_one_line(pair):
    free, _ = torch.cuda.mem_get_info(GPU)
    with pytest.raises(OffspecError) as info:
        offspec.load(str(pair[0]), str(pair[1]), device=str(GPU), device_mem=str(free + 10**10))
    assert "\n" not in str(info.value) and "free on cuda:0" in str(info.value)


@pytest.mark.parametrize("when,step", [("loading the models", "placement"), ("the warm-up", "warmup")])
def test_a_cuda_out_of_memory_error_is_one_line(pair, tmp_path, monkeypatch, when, step):
    """A real CUDA out-of-memory error (an allocation of 4x the GPU) raised while the target is being placed and
    loaded, or in the warm-up's first forward pass."""
    from offspec.spec.runner import ModelRunner

    total = torch.cuda.get_device_properties(GPU).total_memory
    armed = []
    forward = ModelRunner.forward

    def too_big():
        torch.empty(4 * total, dtype=torch.uint8, device=GPU)

    def progress(event):
        if event.step == step == "placement":
            too_big()
        elif event.step == step:
            armed.append(True)

    def forward_when_armed(self, *args, **kwargs):
        if armed:
            too_big()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", forward_when_armed)
    with pytest.raises(OffspecError) as info:
        offspec.load(str(pair[0]), str(pair[1]), device=str(GPU), offload_dir=str(tmp_path), progress=progress)
    message = str(info.value)
    assert "\n" not in message and f"out of device memory on cuda:0 during {when}" in message
    assert re.search(r"tried to allocate [\d.]+ ?GiB", message)


# --- streaming on the GPU ----------------------------------------------------------------------------
def test_speculation_with_a_streamed_target_on_the_gpu_is_lossless(pair, tmp_path):
    options = dict(device=str(GPU), dtype="float32", max_context=256, max_budget=64)
    with pytest.raises(OffspecError) as info:
        offspec.load(str(pair[0]), str(pair[1]), device_mem="1KB", offload_dir=str(tmp_path), **options)
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    gen = offspec.load(str(pair[0]), str(pair[1]), device_mem=budget, ram_mem="1MB", offload_dir=str(tmp_path),
                       **options)
    placement = gen.info.extra["placement"]
    assert placement["layers"]["device"] < 6 and gen.engine.target.io is not None
    assert all(s.ram.is_pinned() for s in gen.engine.target.io._p.order if s.ram is not None)
    plain = offspec.load(str(pair[0]), str(pair[1]), **options).generate("Hello there", max_new_tokens=40,
                                                                         speculate=False)
    for budget_nodes in (1, 8, 64):
        result = gen.generate("Hello there", max_new_tokens=40, budget=budget_nodes)
        assert result.token_ids == plain.token_ids
        assert all(p.bytes_streamed == placement["bytes_per_pass"] for p in result.passes)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (cuda:1 must be honoured)")
def test_cuda_1_is_honoured_everywhere(pair, tmp_path):
    before = torch.cuda.memory_reserved(0)
    gen = offspec.load(str(pair[0]), str(pair[1]), device="cuda:1", dtype="float32", max_context=128,
                       max_budget=16, budget=8, device_mem="64MB", ram_mem="1MB", offload_dir=str(tmp_path))
    assert gen.info.device == "cuda:1" and gen.engine.target.device == torch.device("cuda", 1)
    gen.generate("Hello", max_new_tokens=8)
    assert torch.cuda.memory_reserved(0) == before  # nothing allocated on GPU 0


def test_quick_profile_on_the_gpu_with_a_streamed_target(pair, tmp_path, monkeypatch):
    """`offspec profile --quick` end to end on the GPU (every drafter's acceptance, the plan), the target streamed
    from pinned RAM: its trees live on the GPU, which the CPU runs of the same command never exercise."""
    from offspec.cli.profile import profile_main
    from offspec.profile.store import load_profile

    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    common = ["--target", str(pair[0]), "--draft", str(pair[1]), "--device", str(GPU), "--dtype", "float32",
              "--max-context", "256", "--max-budget", "64", "--offload-dir", str(tmp_path / "offload")]
    with pytest.raises(OffspecError) as info:
        offspec.load(str(pair[0]), str(pair[1]), device=str(GPU), dtype="float32", max_context=256,
                     max_budget=64, device_mem="1KB", offload_dir=str(tmp_path / "offload"))
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    rc = profile_main(common + ["--device-mem", budget, "--quick", "--prompts", "2",
                                "--passes", "2", "--out", str(tmp_path / "gpu.json")])
    assert rc == 0
    data = load_profile(tmp_path / "gpu.json")
    assert data["hardware"]["device_type"] == "cuda"
    assert all(seconds > 0 for _, seconds in data["timings"]["target_pass"])
    for key in ("acceptance", "acceptance_suffix", "acceptance_hybrid"):
        assert data[key]["budgets"][0] == 1, key
    assert data["plan"]["predicted_tokens_per_second"] > 0
