"""A mixture's experts held in pinned RAM and copied into an expert cache on the GPU (offspec/offload/ram_experts.py),
on the real thing (`pytest -m cuda`): the copies of misses on the compute stream, the copies ahead on a side stream,
and the events between them never hand a kernel a slot's old bytes or a half-copied one, with the host running far
ahead of the GPU; and a tiny mixture under a tight device budget, its experts in pinned RAM, decodes as it does
resident. The same cache's counts on a CPU: tests/test_expert_cache.py; its model on a CPU: tests/test_moe.py.
Skipped, with the reason shown, where there is no CUDA GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.gpu_device import GPU, cuda_marks

pytestmark = cuda_marks()


def test_every_routed_expert_reaches_its_kernel_whole_under_copies_ahead_and_slow_compute():
    from offspec.offload.diskio import aligned_empty
    from offspec.offload.ram_experts import RamExpertCache

    layers, experts, nbytes = 3, 12, 256 * 1024
    host = {}
    for layer in range(layers):  # expert e of layer l: float32 values 100 l + e + 1 everywhere, in pinned RAM
        buf = aligned_empty(experts * nbytes, pin=True, device=GPU)
        buf.view(torch.float32).view(experts, -1).copy_(
            (100 * layer + torch.arange(experts, dtype=torch.float32) + 1)[:, None])
        host[layer] = [buf[e * nbytes : (e + 1) * nbytes] for e in range(experts)]
        assert host[layer][0].is_pinned()
    cache = RamExpertCache(5 * nbytes, nbytes, GPU)
    for layer in range(layers):
        cache.register(layer, host[layer])
    big = torch.randn(2048, 2048, device=GPU)  # (2048, 2048) slow compute queued before each read
    rng = random.Random(0)
    sums, want = [], []
    for step in range(200):
        layer = step % layers
        routed = sorted(rng.sample(range(experts), rng.randint(1, 4)))
        views = cache.fetch(layer, routed)
        cache.prefetch((layer + 1) % layers, sorted(rng.sample(range(experts), rng.randint(1, 5))))
        for _ in range(2):
            torch.mm(big, big)
        for e in routed:  # queued: read when the compute gets there
            sums.append(views[e].view(torch.float32).sum())
            want.append((100 * layer + e + 1) * nbytes / 4)
    got = torch.stack(sums).cpu()  # one sync, at the end
    assert torch.equal(got, torch.tensor(want, dtype=torch.float32))
    stats = cache.stats()
    assert stats["prefetch_reads"] > 0 and stats["prefetch_used"] > 0
    assert cache.reads == cache.asked - cache.hits + stats["prefetch_reads"]
    assert cache.counters()[0] == cache.reads * nbytes and cache.counters()[1] > 0  # the misses' copies, timed
    cache.close()


def test_a_mixture_with_its_experts_in_pinned_ram_decodes_as_it_does_resident(tmp_path, monkeypatch):
    import re

    from helpers.tiny_gguf import save_tiny_gguf

    import offspec
    from offspec import OffspecError
    from offspec.util.sizes import parse_size

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = str(save_tiny_gguf(tmp_path / "t.gguf", "qwen3moe", seed=0, layers=8, head_dim=128))
    draft = str(save_tiny_gguf(tmp_path / "d.gguf", "qwen3moe", seed=0, layers=8, noise=0.002, head_dim=128))
    load = dict(device=str(GPU), max_context=256, max_budget=64)
    prompt = [5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7, 18, 64, 90, 91, 92]
    plain = offspec.load(target, draft, **load).generate(prompt, max_new_tokens=32, speculate=False).token_ids
    with pytest.raises(OffspecError) as info:
        offspec.load(target, draft, device_mem="1KB", ram_mem="2GB", offload_dir=str(tmp_path), **load)
    budget = parse_size(re.search(r"--device-mem (\S+)", str(info.value))[1], "device_mem") + 3 * 2**20
    gen = offspec.load(target, draft, device_mem=budget, ram_mem="2GB", offload_dir=str(tmp_path), **load)
    placement = gen.info.extra["placement"]
    assert placement["expert_host_bytes"] > 0 and placement["expert_cache_bytes"] > 0, placement
    experts = gen.engine.target.io
    assert experts.source == "ram" and experts.device.type == "cuda" and 8 <= experts.slots < 64
    assert gen.generate(prompt, max_new_tokens=32, speculate=False).token_ids == plain
    for nodes in (1, 16):
        assert gen.generate(prompt, max_new_tokens=32, budget=nodes).token_ids == plain, nodes
    stats = experts.stats()
    assert 0 < stats["expert_hits"] < stats["experts_asked"] and stats["prefetch_reads"] > 0
    gen.close()
