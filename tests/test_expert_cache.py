"""The expert cache and the placement of a mixture whose experts are read as routed (offspec/offload/experts.py,
offspec/offload/placement.py), tier 1: scripted files and sizes with exact expected reads, hits and bytes. The
models that run through them are tests/test_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offspec import OffspecError


def _cache_file(path: Path, experts: int, nbytes: int) -> tuple:
    """A packed-like file: the header, then `experts` ranges of `nbytes`, range e filled with byte e."""
    import zlib

    from offspec.store.packed import HEADER

    data = bytearray(HEADER) + b"".join(bytes([e]) * nbytes for e in range(experts))
    path.write_bytes(bytes(data))
    return tuple((e * nbytes, nbytes, zlib.crc32(bytes([e]) * nbytes)) for e in range(experts))


@pytest.mark.parametrize("policy, reads, hits", [
    ("lru", 8, 3),  # 3 pushes out 2, 4 pushes out 0, 2 pushes out 1: the last call reads 0 and 1 again
    ("lfu", 6, 5),  # 3 pushes out 2 (routed once), 4 pushes out 3, 2 pushes out 4: 0 and 1 (routed most) stay
])
def test_the_expert_cache_reads_and_hits_exactly_as_its_policy_says(tmp_path, policy, reads, hits):
    from offspec.offload.diskio import FileReader
    from offspec.offload.experts import ExpertCache

    ranges = _cache_file(tmp_path / "layer.bin", 6, 4096)
    cache = ExpertCache(3 * 4096, 4096, FileReader(), policy=policy, prefetch=False)
    cache.register(0, tmp_path / "layer.bin", ranges)
    for call in ([0, 1], [1, 2], [0, 1], [3], [4], [2], [0, 1]):  # 3 slots
        views = cache.fetch(0, call)
        assert sorted(views) == call and all(bool((views[e] == e).all()) for e in call)  # each expert's own bytes
    assert (cache.reads, cache.hits, cache.asked) == (reads, hits, 11)
    assert {e for (_, e) in cache.slot_of} == {0, 1, 2}
    assert cache.read_bytes == reads * 4096 and cache.counters()[0] == reads * 4096


def test_a_damaged_expert_read_as_routed_is_one_line_and_marks_the_store(tmp_path):
    from offspec.offload.diskio import FileReader
    from offspec.offload.experts import ExpertCache

    ranges = _cache_file(tmp_path / "layer.bin", 4, 4096)
    data = bytearray((tmp_path / "layer.bin").read_bytes())
    data[4096 + 2 * 4096 + 7] ^= 0xFF  # one byte of expert 2
    (tmp_path / "layer.bin").write_bytes(bytes(data))
    marked = []
    cache = ExpertCache(4 * 4096, 4096, FileReader(), on_corrupt=lambda: marked.append(1) or "rebuilt next start",
                        prefetch=False)
    cache.register(3, tmp_path / "layer.bin", ranges)
    assert sorted(cache.fetch(3, [0, 1])) == [0, 1]
    with pytest.raises(OffspecError, match=r"layer.bin is corrupt \(expert 2: checksum mismatch\); rebuilt next"):
        cache.fetch(3, [2])
    assert marked == [1]


def test_a_read_ahead_is_used_waited_for_and_never_drops_the_running_calls_experts(tmp_path):
    """A scripted prediction: what the next call asks for is there (or waited for), what it was not predicted is
    read by the call itself, and a prediction never takes a slot the running call holds."""
    from offspec.offload.diskio import FileReader
    from offspec.offload.experts import ExpertCache

    ranges = _cache_file(tmp_path / "layer.bin", 6, 4096)
    cache = ExpertCache(4 * 4096, 4096, FileReader())
    cache.register(0, tmp_path / "layer.bin", ranges)
    cache.register(1, tmp_path / "layer.bin", ranges)  # layer 1's experts: the same ranges, another key
    views = cache.fetch(0, [0, 1])
    cache.prefetch(1, [2, 3, 4])  # 4 slots, 2 held by the running call: only 2 and 3 can be read ahead
    with cache.cv:  # the reader thread done with the prediction
        assert cache.cv.wait_for(lambda: cache.request is None and not cache.pending, timeout=60)
    assert bool((views[0] == 0).all()) and bool((views[1] == 1).all())  # the running call's experts untouched
    assert {e for (layer, e) in cache.slot_of if layer == 1} == {2, 3}
    got = cache.fetch(1, [2, 3, 5])  # 2 and 3 read ahead; 5 read by the call itself
    assert all(bool((got[e] == e).all()) for e in (2, 3, 5))
    stats = cache.stats()
    assert (stats["prefetch_reads"], stats["prefetch_used"]) == (2, 2)
    assert stats["prefetch_accuracy"] == 2 / 3 and (cache.asked, cache.hits, cache.reads) == (5, 2, 5)
    cache.close()


def test_the_placement_keeps_the_dense_parts_and_gives_the_rest_to_the_expert_cache():
    """Scripted sizes: 8 layers of 100 MB, 80 of them 8 experts of 10 MB. The dense parts and the resident parts
    first, then whole 10 MB slots; fewer slots than one layer's experts is too small a budget (the error says what
    would do); --experts whole streams the layers whole."""
    from offspec.config import OffloadConfig
    from offspec.offload.placement import ModelSizes, plan_placement

    M = 10**6
    sizes = ModelSizes(layer_bytes=(100 * M,) * 8, file_bytes=101 * M, other_bytes=10 * M, kv_bytes=5 * M,
                       activation_bytes=5 * M, expert_bytes=(80 * M,) * 8, expert_unit=10 * M, experts_per_layer=8,
                       experts_used=2)
    cpu = torch.device("cpu")
    placed = plan_placement(sizes, cpu, OffloadConfig(device_mem=20 * M + 160 * M + 85 * M))
    assert placed.tiers == ("device",) * 8 and placed.expert_cache_bytes == 80 * M  # 8 whole slots of the 85 MB
    assert placed.bytes_in("device") == 160 * M and placed.device_bytes == 20 * M + 160 * M + 80 * M
    assert placed.device_breakdown()["expert cache"] == 80 * M and "experts from SSD as routed" in placed.describe()
    assert placed.predicted_pass_seconds == pytest.approx((160 + 8 * 2 * 10 + 10) * M / 12e9)  # routed experts only
    with pytest.raises(OffspecError, match=r"use --device-mem 2\d\dMB or more"):  # 7 slots: too few
        plan_placement(sizes, cpu, OffloadConfig(device_mem=20 * M + 160 * M + 75 * M))
    whole = plan_placement(sizes, cpu, OffloadConfig(device_mem=500 * M, experts="whole"))
    assert whole.expert_cache_bytes == 0 and "ssd" in whole.tiers
    fits = plan_placement(sizes, cpu, OffloadConfig(device_mem=900 * M))
    assert fits.expert_cache_bytes == 0 and fits.tiers == ("device",) * 8


def _host_experts(experts: int, nbytes: int) -> list[torch.Tensor]:
    """Host views as a RAM-held layer's: expert e's (nbytes,) bytes all e."""
    return [torch.full((nbytes,), e, dtype=torch.uint8) for e in range(experts)]


@pytest.mark.parametrize("policy, reads, hits", [("lru", 8, 3), ("lfu", 6, 5)])  # the SSD cache's own counts
def test_experts_held_in_ram_are_copied_and_hit_exactly_as_the_policy_says(policy, reads, hits):
    from offspec.offload.ram_experts import RamExpertCache

    cache = RamExpertCache(3 * 4096, 4096, torch.device("cpu"), policy=policy, prefetch=False)
    cache.register(0, _host_experts(6, 4000))
    for call in ([0, 1], [1, 2], [0, 1], [3], [4], [2], [0, 1]):
        views = cache.fetch(0, call)
        assert sorted(views) == call and all(bool((views[e] == e).all()) and views[e].numel() == 4000 for e in call)
        assert all(views[e].data_ptr() != cache.host[0][e].data_ptr() for e in call)  # copies, in the cache's slots
    assert (cache.reads, cache.hits, cache.asked) == (reads, hits, 11)
    assert cache.counters()[0] == reads * 4000 and cache.stats()["expert_source"] == "ram"


def test_a_copy_ahead_from_ram_is_used_and_never_drops_the_running_calls_experts():
    from offspec.offload.experts import ExpertStream
    from offspec.offload.ram_experts import RamExpertCache

    cache = RamExpertCache(4 * 4096, 4096, torch.device("cpu"))
    cache.register(0, _host_experts(6, 4096))
    cache.register(1, [v.clone() + 10 for v in _host_experts(6, 4096)])  # layer 1: bytes 10 + e
    views = cache.fetch(0, [0, 1])
    cache.prefetch(1, [2, 3, 4])  # 4 slots, 2 held by the running call: only 2 and 3 are copied ahead
    assert bool((views[0] == 0).all()) and bool((views[1] == 1).all())
    assert {e for (layer, e) in cache.slot_of if layer == 1} == {2, 3}
    got = cache.fetch(1, [2, 3, 5])
    assert all(bool((got[e] == 10 + e).all()) for e in (2, 3, 5))
    stats = cache.stats()
    assert (stats["prefetch_reads"], stats["prefetch_used"], stats["prefetch_accuracy"]) == (2, 2, 2 / 3)
    assert (cache.asked, cache.hits, cache.reads) == (5, 2, 5)
    router = lambda x: (None, None, torch.tensor([[4, 0], [4, 5]]))  # noqa: E731  a scripted next router
    ExpertStream(cache, 1, router, 0).prefetch(torch.zeros(2, 8))  # predicts layer 0's experts 0, 4, 5
    # one slot is not the running call's (layer 0's expert 1, pushed out for the first predicted one): 4 and 5 wait
    assert cache.guess[0] == {0, 4, 5} and {key for key in cache.slot_of if key[0] == 0} == {(0, 0)}
    off = RamExpertCache(4 * 4096, 4096, torch.device("cpu"), prefetch=False)
    off.register(1, _host_experts(6, 4096))
    ExpertStream(off, 0, router, 1).prefetch(torch.zeros(2, 8))
    assert off.reads == 0 and not off.prefetching


def test_a_gpu_reads_a_mixtures_experts_from_ram_where_the_ram_budget_holds_them_all():
    """Scripted sizes as above, on a CUDA device (planned only: nothing touches a GPU): the dense parts resident, the
    cache what is left, every expert pinned in RAM (whole pages a layer); a RAM budget short of them streams the
    layers whole; a CPU given that RAM budget reads its experts from RAM too."""
    from offspec.config import OffloadConfig
    from offspec.offload.hostmem import page_round
    from offspec.offload.placement import ModelSizes, plan_placement

    M = 10**6
    sizes = ModelSizes(layer_bytes=(100 * M,) * 8, file_bytes=101 * M, other_bytes=10 * M, kv_bytes=5 * M,
                       activation_bytes=5 * M, workspace_bytes=512 * 2**20, expert_bytes=(80 * M,) * 8,
                       expert_unit=10 * M, experts_per_layer=8, experts_used=2)
    cuda = torch.device("cuda")
    held = 8 * page_round(80 * M)
    resident = 20 * M + 512 * 2**20
    placed = plan_placement(sizes, cuda, OffloadConfig(device_mem=resident + 160 * M + 125 * M, ram_mem=held))
    assert placed.tiers == ("device",) * 8 and placed.expert_cache_bytes == 120 * M
    assert placed.expert_host_bytes == held and placed.host_bytes == held
    assert "experts from RAM as routed" in placed.describe() and placed.summary()["expert_host_bytes"] == held
    short = plan_placement(sizes, cuda, OffloadConfig(device_mem=resident + 160 * M + 125 * M, ram_mem=held - 1))
    assert short.expert_cache_bytes == 0 and short.streams  # whole layers, as before
    cpu = plan_placement(sizes, torch.device("cpu"), OffloadConfig(device_mem=resident + 160 * M + 85 * M,
                                                                   ram_mem=held))
    assert cpu.expert_cache_bytes == 80 * M and cpu.expert_host_bytes == held
    assert "experts from SSD" in plan_placement(sizes, torch.device("cpu"), OffloadConfig(
        device_mem=resident + 160 * M + 85 * M, ram_mem=held - 1)).describe()
