"""Offloading units without models: sizes, placement under budgets, the packed file format, the streamer."""

import errno
import os
import threading
from dataclasses import replace

import pytest
import torch

from offspec import OffspecError
from offspec.offload import diskio
from offspec.offload.config import OffloadConfig, offload_config
from offspec.offload.diskio import FileReader, aligned_empty
from offspec.offload.hostmem import page_round
from offspec.offload.config import CPU_HEADROOM
from offspec.offload.placement import ModelSizes, plan_placement, ram_bytes, spread, stream_buffers
from offspec.offload.streamer import LayerSource, LayerStreamer
from offspec.store.packed import HEADER, StoreInvalid, build_store, ensure_store, open_store, plan_layer, tensor_views
from offspec.util.sizes import format_size, parse_size

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("text,value", [("22GB", 22 * 10**9), ("512MiB", 512 * 2**20), ("1.5g", 1_500_000_000),
                                        ("0", 0), ("4096", 4096), (" 3 kb ", 3000), ("2TiB", 2 * 2**40), (7, 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12XB", "", "GB", "-3GB", "1.2.3GB", "ten"])
def test_parse_size_rejects_bad_input_in_one_line(text):
    with pytest.raises(OffspecError) as info:
        parse_size(text, "device_mem")
    assert "\n" not in str(info.value) and "--device-mem" in str(info.value) or "negative" in str(info.value)


def test_format_size():
    assert format_size(1_234_000_000) == "1.23 GB" and format_size(512) == "512 B"


def _file_bytes(layer):
    return HEADER + -(-layer // HEADER) * HEADER  # as packed.LayerSpec.file_bytes: header + payload padded to 4 KiB


def _sizes(n=8, layer=100, other=50, kv=30, act=20, extra=0):
    return ModelSizes(layer_bytes=(layer,) * n, file_bytes=_file_bytes(layer), other_bytes=other, kv_bytes=kv,
                      activation_bytes=act, extra_bytes=extra)


def test_everything_fits_on_the_device():
    p = plan_placement(_sizes(), CUDA, OffloadConfig(device_mem=1000, ram_mem=0))
    assert p.tiers == ("device",) * 8 and not p.streams and p.bytes_per_pass == 0


def test_cuda_placement_device_then_ram_then_ssd_spread_evenly():
    sizes = _sizes(n=8, layer=100_000)
    # device: 100 resident + 2 ring slots + 3 layers; RAM: 2 staging buffers + 2 layers (not 4: staging comes first);
    # a RAM-tier layer takes its whole packed file (header + payload padded to pages), as it does in memory
    cfg = OffloadConfig(device_mem=100 + 500_000, ram_mem=2 * _file_bytes(100_000) + 2 * ram_bytes(100_000) + 1000)
    p = plan_placement(sizes, CUDA, cfg)
    assert (p.count("device"), p.count("ram"), p.count("ssd")) == (3, 2, 3)
    assert [i for i, t in enumerate(p.tiers) if t == "device"] == spread(8, 3) == [1, 4, 6]
    assert p.bytes_per_pass == 500_000 and p.device_bytes <= cfg.device_mem and p.host_bytes <= cfg.ram_mem
    assert p.summary()["layers"] == {"device": 3, "ram": 2, "ssd": 3}
    assert "3/8 layers on cuda" in p.describe()


def test_cpu_placement_charges_slots_and_staging_to_the_device_budget():
    sizes = _sizes(n=8, layer=100_000)
    staging = 2 * _file_bytes(100_000)
    p = plan_placement(sizes, CPU, OffloadConfig(device_mem=100 + 200_000 + staging + 250_000, ram_mem=0))
    assert (p.count("device"), p.count("ram"), p.count("ssd")) == (2, 0, 6)
    assert p.device_bytes <= p.device_budget and p.host_bytes == 0
    assert sum(p.device_breakdown().values()) == p.device_bytes and "draft" not in p.device_breakdown()
    # files are read straight into the slots: 2 ring + 2 staging slots of a whole (page-rounded) file each
    slots = 4 * page_round(_file_bytes(100_000))
    assert p.device_breakdown()["streaming slots"] == p.ring_bytes + p.staging_bytes == slots
    assert plan_placement(sizes, CPU, OffloadConfig(device_mem=100 + slots + 200_000, ram_mem=0)).count("device") == 2
    assert plan_placement(sizes, CPU, OffloadConfig(device_mem=100 + slots + 199_999, ram_mem=0)).count("device") == 1
    with_draft = plan_placement(_sizes(n=8, layer=100_000, extra=40),
                                CPU, OffloadConfig(device_mem=140 + 200_000 + staging + 250_000, ram_mem=0))
    assert with_draft.tiers == p.tiers and with_draft.device_breakdown()["draft"] == 40
    assert "(2 layers 200 KB, draft 40 B," in with_draft.describe()  # says what the device budget holds
    p = plan_placement(sizes, CPU, OffloadConfig(device_mem=200_100, ram_mem=8 * ram_bytes(100_000)))  # no staging
    assert (p.count("device"), p.count("ram"), p.count("ssd")) == (0, 8, 0)


def test_a_self_draft_runs_the_resident_layers_as_the_targets_and_the_placement_counts_their_copies_gone():
    # 16 layers of 100 KB; the draft's copy of each is 50 KB (800 KB of copies + 20 B of its own)
    sizes = replace(_sizes(n=16, layer=100_000, extra=800_020), shared_bytes=(50_000,) * 16)
    base = 100 + 800_020  # the target's other parts, KV cache and activations; the whole draft
    slots = 4 * page_round(_file_bytes(100_000))  # 2 ring + 2 staging slots
    # room for 2 resident layers at their whole bytes is room for 4 at 50 KB each (the copy goes where one is)
    p = plan_placement(sizes, CPU, OffloadConfig(device_mem=base + slots + 200_000, ram_mem=0))
    assert p.count("device") == 4 and p.shared_layers == tuple(spread(16, 4)) and p.shared_bytes == 200_000
    assert p.device_bytes <= p.device_budget and sum(p.device_breakdown().values()) == p.device_bytes
    assert p.device_breakdown()["draft (its copies of 4 layers: the target's)"] == 600_020
    assert p.summary()["shared_layers"] == 4 and "4/16 layers on cpu" in p.describe()
    # the target and the whole copy fit: the copy drafts (cheaper than the target's layers), nothing is shared
    whole = plan_placement(sizes, CPU, OffloadConfig(device_mem=base + 1_600_000, ram_mem=0))
    assert not whole.streams and whole.shared_layers == () and whole.device_breakdown()["draft"] == 800_020
    # the target fits whole only with the draft running its layers: every layer is the target's
    shared = plan_placement(sizes, CPU, OffloadConfig(device_mem=base + 800_000, ram_mem=0))
    assert not shared.streams and shared.shared_layers == tuple(range(16)) and shared.device_bytes == base + 800_000
    # another draft: resident layers cost their whole bytes, as before
    other = plan_placement(_sizes(n=16, layer=100_000, extra=800_020),
                           CPU, OffloadConfig(device_mem=base + slots + 200_000, ram_mem=0))
    assert other.count("device") == 2 and other.shared_layers == ()


@pytest.mark.parametrize("device,cfg,flag", [
    (CUDA, OffloadConfig(device_mem=250, ram_mem=10**6), "--device-mem"),  # resident 100 + ring 200 > 250
    (CPU, OffloadConfig(device_mem=350, ram_mem=0), "--device-mem"),  # no room for the SSD staging buffers
    (CUDA, OffloadConfig(device_mem=400, ram_mem=100), "--ram-mem"),  # no room for the SSD staging buffers
])
def test_budget_too_small_is_one_line_saying_what_to_do(device, cfg, flag):
    with pytest.raises(OffspecError) as info:
        plan_placement(_sizes(), device, cfg)
    message = str(info.value)
    assert "\n" not in message and flag in message and "too small" in message
    suggested = parse_size(message.split(flag + " ")[1].split()[0])
    fixed = {"--device-mem": dict(device_mem=suggested), "--ram-mem": dict(ram_mem=suggested)}[flag]
    plan_placement(_sizes(), device, OffloadConfig(**{**cfg.__dict__, **fixed}))  # the suggestion works
    assert "--draft none" not in message  # no draft: nothing to say of it
    if flag == "--device-mem":  # a resident draft shares the device budget: the message says what it takes
        with pytest.raises(OffspecError) as info:
            plan_placement(_sizes(extra=40), device, cfg)
        assert "(the draft takes 40 B of them: a smaller --draft-vocab frees some, --draft none all)" in str(info.value)


def test_a_cpu_budget_keeps_its_headroom_free_and_the_suggested_budget_fits():
    """A CPU budget given holds the whole process; the plan leaves CPU_HEADROOM of it free (what the runtime measure
    misses). The headroom grows with the budget, and the budget a too-small one suggests fits with its own."""
    def sizes(budget):
        return replace(_sizes(n=8, layer=100_000), headroom_bytes=int(budget * CPU_HEADROOM))

    budget = 300_000
    with pytest.raises(OffspecError) as info:
        plan_placement(sizes(budget), CPU, OffloadConfig(device_mem=budget, ram_mem=0))
    suggested = parse_size(str(info.value).split("--device-mem ")[1].split()[0])
    p = plan_placement(sizes(suggested), CPU, OffloadConfig(device_mem=suggested, ram_mem=0))
    assert p.device_breakdown()["headroom"] == int(suggested * CPU_HEADROOM)
    assert p.device_bytes <= suggested and p.device_bytes - p.sizes.headroom_bytes <= suggested * (1 - CPU_HEADROOM)
    smaller = int(suggested * 0.99)
    with pytest.raises(OffspecError):  # the suggestion is the smallest (to its 3 digits)
        plan_placement(sizes(smaller), CPU, OffloadConfig(device_mem=smaller, ram_mem=0))


def test_staging_buffers_zero_leaves_a_cpu_two_slots_and_cuda_one_staging_buffer():
    sizes, zero = _sizes(n=8, layer=100_000), OffloadConfig(staging_buffers=0).validate()
    file = page_round(_file_bytes(100_000))
    assert stream_buffers(sizes, zero, host_is_device=True, has_ssd=True) == (2 * file, 0)
    assert stream_buffers(sizes, zero, host_is_device=False, has_ssd=True) == (2 * 100_000, file)
    with pytest.raises(OffspecError, match="staging_buffers must be >= 0"):
        OffloadConfig(staging_buffers=-1).validate()


def test_bad_options_are_one_line_errors():
    with pytest.raises(OffspecError, match="device_mem"):
        offload_config(device_mem="12XB")
    with pytest.raises(OffspecError, match="quant"):
        offload_config(quant="int3")


def _fake_layer(i, n=3):
    return {"a.weight": torch.arange(n * 5, dtype=torch.float32).reshape(n, 5) + i,
            "b": torch.full((7,), i, dtype=torch.int8)}


def _plans(n_layers=3):
    return [plan_layer(i, [(k, v.dtype, tuple(v.shape)) for k, v in _fake_layer(i).items()]) for i in range(n_layers)]


def test_packed_set_round_trip_and_invalid_sets(tmp_path):
    events = []
    d = tmp_path / "set"
    packed = build_store(d, {"k": 1}, _plans(), lambda i: _fake_layer(i).items(), events.append, "pack", "packing")
    assert events[-1].finished and events[-1].step == "pack"
    names = sorted(p.name for p in d.iterdir())
    assert names == ["layer-0000.bin", "layer-0001.bin", "layer-0002.bin", "manifest.json"]
    again = open_store(d, {"k": 1})
    assert again.layers == packed.layers
    buf = aligned_empty(packed.layers[1].file_bytes)
    FileReader().read(packed.path(1), buf, packed.layers[1].file_bytes)
    views = tensor_views(buf[HEADER:], packed.layers[1])
    assert torch.equal(views["a.weight"], _fake_layer(1)["a.weight"]) and torch.equal(views["b"], _fake_layer(1)["b"])
    with pytest.raises(StoreInvalid, match="another model"):
        open_store(d, {"k": 2})
    path = packed.path(2)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(StoreInvalid, match="truncated"):
        open_store(d, {"k": 1})
    events.clear()
    rebuilt = ensure_store(d, {"k": 1}, _plans(), lambda i: _fake_layer(i).items(), events.append, "pack", "packing")
    assert "rebuilding" in events[0].message and rebuilt.set_id != packed.set_id
    path.write_bytes(b"garbage!" + path.read_bytes()[8:])
    with pytest.raises(StoreInvalid, match="magic"):
        open_store(d, {"k": 1})
    (d / "manifest.json").unlink()
    with pytest.raises(StoreInvalid, match="no manifest"):
        open_store(d, {"k": 1})


def test_buffered_reads_when_direct_io_is_off(tmp_path):
    packed = build_store(tmp_path / "s", {}, _plans(1), lambda i: _fake_layer(i).items(), lambda e: None, "pack", "p")
    reader = FileReader(direct=False)
    buf = aligned_empty(packed.layers[0].file_bytes)
    reader.read(packed.path(0), buf, packed.layers[0].file_bytes)
    assert reader.mode == "buffered+dontneed"
    assert torch.equal(tensor_views(buf[HEADER:], packed.layers[0])["b"], _fake_layer(0)["b"])


@pytest.mark.parametrize("tiers", [("ram",) * 5, ("ssd",) * 5, ("ssd", "ram", "ssd", "ssd", "ram")])
def test_streamer_serves_every_layer_in_order_across_passes_and_recovers_from_interruptions(tmp_path, tiers):
    n = len(tiers)
    packed = build_store(tmp_path / "s", {}, _plans(n), lambda i: _fake_layer(i).items(), lambda e: None, "pack", "p")
    sources = []
    for i, tier in enumerate(tiers):
        spec = packed.layers[i]
        if tier == "ram":
            buf = aligned_empty(spec.file_bytes)
            FileReader().read(packed.path(i), buf, spec.file_bytes)
            sources.append(LayerSource(i, spec, ram=buf[HEADER : HEADER + spec.nbytes]))
        else:
            sources.append(LayerSource(i, spec, path=packed.path(i)))
    streamer = LayerStreamer(CPU, sources, ring_slots=2, staging_buffers=2, set_id=packed.set_id)
    p = streamer._p
    if "ssd" in tiers:  # CPU: files are read into the slots (2 + 2 of a whole file each) by two fillers
        assert p.direct and p.staging == [] and len(p.slots) == 4 and p.offset == HEADER
        assert p.slot_bytes == page_round(max(s.spec.file_bytes for s in sources))
        assert sorted(t.name for t in p.threads) == ["offspec-filler-0", "offspec-filler-1"]
    else:  # RAM tier only: copies into 2 payload-sized slots
        assert not p.direct and len(p.slots) == 2 and p.slot_bytes == max(s.spec.nbytes for s in sources)
    per_pass = sum(s.spec.nbytes for s in sources)
    for _ in range(3):
        for i in range(n):
            payload = streamer.acquire(i)
            assert torch.equal(tensor_views(payload, packed.layers[i])["a.weight"], _fake_layer(i)["a.weight"])
            streamer.release(i)
    assert streamer.counters()[0] == 3 * per_pass
    streamer.acquire(0)  # an interrupted pass: layer 0 is never released ...
    for i in range(n):  # ... the next pass restarts the cycle and still gets the right weights
        assert torch.equal(tensor_views(streamer.acquire(i), packed.layers[i])["b"], _fake_layer(i)["b"])
        streamer.release(i)
    streamer.acquire(2)  # out of order (e.g. a pass that failed after layer 1): restarts at layer 2
    payload = streamer._p.slots[0][streamer._p.offset :]  # after the file header where files are read into slots
    assert torch.equal(tensor_views(payload, packed.layers[2])["b"], _fake_layer(2)["b"])
    streamer.release(2)
    threads = list(streamer._p.threads)
    streamer.close()
    assert not any(t.is_alive() for t in threads)
    assert threading.active_count() >= 1


def test_a_cpu_streamer_without_staging_reads_one_layer_ahead_into_two_slots(tmp_path):
    n = 5
    packed = build_store(tmp_path / "s", {}, _plans(n), lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    sources = [LayerSource(i, packed.layers[i], path=packed.path(i)) for i in range(n)]
    streamer = LayerStreamer(CPU, sources, ring_slots=2, staging_buffers=0, set_id=packed.set_id)
    assert streamer._p.direct and len(streamer._p.slots) == 2 and streamer._p.staging == []
    for _ in range(3):
        for i in range(n):
            payload = streamer.acquire(i)
            assert torch.equal(tensor_views(payload, packed.layers[i])["a.weight"], _fake_layer(i)["a.weight"])
            streamer.release(i)
    streamer.close()


def test_cpu_streamer_keeps_two_reads_in_flight_into_the_slots(tmp_path):
    """Each read waits until a second one has started (a barrier of 2): with one read at a time the barrier
    breaks and the first acquire fails. The reads land in the slots themselves: no staging buffer, no copy."""
    n = 6
    packed = build_store(tmp_path / "s", {}, _plans(n), lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    barrier = threading.Barrier(2, timeout=10)
    targets = []

    class PairedReader(FileReader):
        def read(self, path, into, nbytes):
            targets.append(into.data_ptr())
            barrier.wait()  # raises BrokenBarrierError if no second read starts
            return super().read(path, into, nbytes)

    sources = [LayerSource(i, packed.layers[i], path=packed.path(i)) for i in range(n)]
    streamer = LayerStreamer(CPU, sources, ring_slots=2, staging_buffers=2, reader=PairedReader(), set_id=packed.set_id)
    for _ in range(2):
        for i in range(n):
            assert torch.equal(tensor_views(streamer.acquire(i), packed.layers[i])["b"], _fake_layer(i)["b"])
            streamer.release(i)
    slots = {t.data_ptr() for t in streamer._p.slots}
    assert set(targets) == slots and streamer.stats()["copy_seconds"] == 0.0
    barrier.abort()  # a filler may be waiting for a partner read that the full ring holds back
    streamer.close()


@pytest.mark.parametrize("code", sorted({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EFAULT}))
def test_direct_reads_fall_back_where_the_file_system_refuses_them(tmp_path, monkeypatch, code):
    """tmpfs on older kernels and some network file systems answer EINVAL, FUSE ones EOPNOTSUPP/ENOTSUP, and a
    buffer the kernel cannot DMA into EFAULT: all are read buffered instead."""
    packed = build_store(tmp_path / "s", {}, _plans(1), lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    reader = FileReader(direct=True)
    assert reader.probe(packed.path(0)) == "buffered+dontneed"
    buf = aligned_empty(packed.layers[0].file_bytes)
    reader.read(packed.path(0), buf, packed.layers[0].file_bytes)
    assert torch.equal(tensor_views(buf[HEADER:], packed.layers[0])["b"], _fake_layer(0)["b"])


def test_other_read_errors_are_not_mistaken_for_a_refused_o_direct(tmp_path, monkeypatch):
    packed = build_store(tmp_path / "s", {}, _plans(1), lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    monkeypatch.setattr(os, "open", lambda *a: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied")))
    reader = FileReader(direct=True)
    with pytest.raises(PermissionError):
        reader.read(packed.path(0), aligned_empty(packed.layers[0].file_bytes), packed.layers[0].file_bytes)
    assert reader.mode == "direct"


def test_reads_work_without_os_preadv_as_on_windows(tmp_path, monkeypatch):
    packed = build_store(tmp_path / "s", {}, _plans(2), lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    monkeypatch.delattr(os, "preadv")
    monkeypatch.setattr(diskio, "CHUNK", 4096)  # several positioned reads per file
    for direct in (True, False):
        reader = FileReader(direct=direct)
        buf = aligned_empty(packed.layers[1].file_bytes)
        reader.read(packed.path(1), buf, packed.layers[1].file_bytes)
        assert torch.equal(tensor_views(buf[HEADER:], packed.layers[1])["a.weight"], _fake_layer(1)["a.weight"])
