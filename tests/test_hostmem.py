"""Host buffers: page-aligned, exact pages, pinned by registration and unpinned when the last view goes; what the
placement charges for the RAM tier is what it really takes. The CUDA runtime is a fake here (no GPU on this
machine); tests/test_cuda.py checks the real registration where CUDA exists."""

import gc

import pytest
import torch

from offspec import OffspecError
from offspec.offload import hostmem
from offspec.offload.config import HOST_RESERVE, OffloadConfig
from offspec.offload.hostmem import PAGE, host_buffer, page_round, pinned_bytes
from offspec.offload.placement import ModelSizes, plan_placement, ram_bytes
from offspec.store.packed import HEADER


class FakeRuntime:
    """What cudaHostRegister / cudaHostUnregister were asked, and on which device."""

    def __init__(self, fail_with: int = 0):
        self.registered, self.unregistered, self.fail_with = [], [], fail_with
        self.device = None

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        self.registered.append((ptr, size, flags, self.device))
        return self.fail_with

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append((ptr, self.device))
        return 0


@pytest.fixture
def runtime(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(hostmem, "_runtime", lambda: fake)

    class OnDevice:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            fake.device = self.device

        def __exit__(self, *exc):
            fake.device = None

    monkeypatch.setattr(hostmem, "_on_device", OnDevice)
    return fake


def test_a_host_buffer_is_page_aligned_and_takes_whole_pages_not_a_power_of_two():
    for nbytes in (1, 4096, 10_000, 3 * 2**20 + 5):
        buf = host_buffer(nbytes)
        assert buf.numel() == nbytes and buf.dtype == torch.uint8
        assert buf.data_ptr() % PAGE == 0 and buf.data_ptr() % 4096 == 0
        assert buf.untyped_storage().nbytes() == page_round(nbytes) < nbytes + PAGE
    big = 1_710_000_000  # a 70B bfloat16 layer: PyTorch's pinned allocator would take 2**31 = 2.15 GB for it
    assert page_round(big) - big < PAGE


def test_pinned_buffers_register_exact_pages_on_their_device_and_unpin_when_the_last_view_goes(runtime):
    device = torch.device("cuda", 1)
    before = pinned_bytes()
    buf = host_buffer(10_000, pin=True, device=device)
    ptr = buf.data_ptr()
    assert runtime.registered == [(ptr, page_round(10_000), hostmem.HOST_REGISTER_PORTABLE, device)]
    assert pinned_bytes() == before + page_round(10_000)
    view = buf[4096:8192].view(torch.int32)  # e.g. a payload view handed to the streamer
    del buf
    gc.collect()
    assert runtime.unregistered == []  # still viewed: still pinned
    view.fill_(7)  # and still mapped
    del view
    gc.collect()
    assert runtime.unregistered == [(ptr, device)] and pinned_bytes() == before


def test_a_registration_the_os_refuses_is_one_line_saying_what_to_do(runtime):
    runtime.fail_with = 2  # cudaErrorMemoryAllocation
    before = pinned_bytes()
    with pytest.raises(OffspecError) as info:
        host_buffer(1 << 20, pin=True)
    message = str(info.value)
    assert "\n" not in message and "cannot pin 1.05 MB" in message and "--ram-mem" in message
    assert pinned_bytes() == before


def test_unpinned_buffers_never_touch_cuda(runtime):
    host_buffer(1 << 20)
    assert runtime.registered == []


def _seventy_b(n_layers=80, payload=1_710_000_000):
    """A 70B bfloat16 target's sizes: 80 layers of 1.71 GB, 2 GB of embeddings and head, 2.7 GB of headroom."""
    return ModelSizes(layer_bytes=(payload,) * n_layers, file_bytes=HEADER + -(-payload // HEADER) * HEADER,
                      other_bytes=2 * 10**9, kv_bytes=2 * 10**9, activation_bytes=7 * 10**8,
                      extra_bytes=10**9, workspace_bytes=512 * 2**20)


def test_default_ram_budget_never_asks_to_pin_more_than_is_available(monkeypatch):
    """A 24 GB card with 23.5 GB free and 60 GB of available RAM: every byte the placement puts in RAM (RAM-tier
    layers as whole page-rounded files, SSD staging buffers) is charged, and the total stays under what exists."""
    import psutil

    available = 60 * 10**9

    class Memory:
        pass

    memory = Memory()
    memory.available = available
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(23.5e9), int(25.3e9)))
    sizes = _seventy_b()
    p = plan_placement(sizes, torch.device("cuda", 0), OffloadConfig())
    assert p.count("ram") > 0 and p.count("ssd") > 0 and p.budget_source == "free memory"
    # what loading would really take: a host_buffer(file_bytes) per RAM-tier layer and per staging buffer
    real = p.count("ram") * page_round(sizes.file_bytes) + 2 * page_round(sizes.file_bytes)
    assert p.host_bytes == real <= p.ram_budget <= available - HOST_RESERVE
    assert ram_bytes(sizes.layer_bytes[0]) == page_round(sizes.file_bytes) > sizes.layer_bytes[0]
