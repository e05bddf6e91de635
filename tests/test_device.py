"""The device: cuda:N honoured, float16 below compute capability 8.0, --device-mem checked against what is free,
out-of-memory at load and at warm-up as one line. torch.cuda's answers are monkeypatched (no GPU here)."""

import pytest
import torch

import offspec
from offspec import OffspecError
from offspec.util.device import (check_device_budget, default_dtype, out_of_memory_error, resolve_device, resolve_dtype,
                                 use_device)
from offspec.util.sizes import parse_size

GB = 10**9


@pytest.fixture
def two_gpus(monkeypatch):
    """Two CUDA GPUs, GPU 1 current; capability, free memory and names per GPU."""
    state = {"current": 1, "set": [], "capability": {0: (8, 9), 1: (7, 5)}, "free": {0: 23 * GB, 1: 14 * GB},
             "reserved": {0: 0, 1: 0}, "allocated": {0: 0, 1: 0}}
    index = lambda d: state["current"] if d is None or torch.device(d).index is None else torch.device(d).index  # noqa

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state["set"].append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: state["capability"][index(d)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: f"Fake GPU {index(d)}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (state["free"][index(d)], 24 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: state["reserved"][index(d)])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: state["allocated"][index(d)])
    return state


def test_cuda_means_the_current_gpu_and_cuda_n_is_honoured(two_gpus):
    assert resolve_device("cuda") == torch.device("cuda", 1)  # an index, so every later call names it
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(None) == torch.device("cuda", 1)
    use_device(torch.device("cuda", 0))
    assert two_gpus["set"] == [torch.device("cuda", 0)]
    with pytest.raises(OffspecError) as info:
        resolve_device("cuda:2")
    assert "\n" not in str(info.value) and "cuda:0 to cuda:1" in str(info.value)
    with pytest.raises(OffspecError, match="cpu, cuda or cuda:N"):
        resolve_device("tpu")


def test_no_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(OffspecError, match="no CUDA GPU is available; use --device cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("capability,dtype", [((6, 1), torch.float16), ((7, 0), torch.float16),
                                              ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                              ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_bfloat16_by_default_only_from_compute_capability_8(two_gpus, capability, dtype):
    two_gpus["capability"][1] = capability  # GTX 10xx (6.1), V100 (7.0), T4 / RTX 20xx (7.5), A100 (8.0) ...
    assert default_dtype(torch.device("cuda", 1)) == resolve_dtype(None, torch.device("cuda", 1)) == dtype
    assert resolve_dtype("bfloat16", torch.device("cuda", 1)) == torch.bfloat16  # asked for: as asked
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_the_default_dtype_is_that_of_the_chosen_gpu(two_gpus):
    assert default_dtype(torch.device("cuda", 0)) == torch.bfloat16  # 8.9
    assert default_dtype(torch.device("cuda", 1)) == torch.float16  # 7.5


def test_device_mem_above_what_is_free_is_refused_in_one_line_with_a_size_that_fits(two_gpus):
    two_gpus["reserved"][0], two_gpus["allocated"][0] = 2 * GB, GB  # PyTorch holds 1 GB it would hand out first
    cuda0 = torch.device("cuda", 0)
    check_device_budget(cuda0, 24 * GB)  # 23 + 1 GB free
    with pytest.raises(OffspecError) as info:
        check_device_budget(cuda0, 25 * GB)
    message = str(info.value)
    assert "\n" not in message and "25 GB is more than the 24 GB free on cuda:0 (Fake GPU 0" in message
    suggested = parse_size(message.split("use --device-mem ")[1].split()[0])
    check_device_budget(cuda0, suggested)  # the suggestion fits
    assert suggested > 23 * GB
    with pytest.raises(OffspecError, match="free on cuda:1"):
        check_device_budget(torch.device("cuda", 1), 22 * GB)  # the README's old example, on a 14 GB-free GPU 1
    check_device_budget(torch.device("cpu"), 10**15)  # nothing to check on a CPU
    check_device_budget(cuda0, None)


def _oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "23.64 GiB of which 1.21 GiB is free.\nIncluding non-PyTorch memory, ...")


def test_out_of_memory_becomes_one_line_that_says_what_to_do():
    error = out_of_memory_error(_oom(), torch.device("cuda", 0), "the warm-up", 20 * GB)
    message = str(error)
    assert "\n" not in message and "out of device memory on cuda:0 during the warm-up" in message
    assert "tried to allocate 2.00 GiB" in message and "20 GB" in message and "--device-mem" in message


def test_out_of_memory_while_loading_is_one_line_not_a_traceback(tiny_dirs, monkeypatch, capsys):
    import offspec.api
    from offspec.cli.main import main

    def oom(*args, **kwargs):
        raise _oom()

    monkeypatch.setattr(offspec.api, "load_pair", oom)
    target, draft = tiny_dirs[("llama", 0)]
    with pytest.raises(OffspecError, match="during loading the models .*tried to allocate 2.00 GiB"):
        offspec.load(str(target), str(draft))
    assert main(["generate", "--target", str(target), "--draft", str(draft), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: out of memory on cpu during loading the models") and "Traceback" not in "".join(err)


def test_out_of_memory_at_the_warm_up_is_one_line(tiny_dirs, monkeypatch):
    from offspec.generator import Generator

    def oom(self, *args, **kwargs):
        raise _oom()

    monkeypatch.setattr(Generator, "generate", oom)
    target, draft = tiny_dirs[("llama", 0)]
    with pytest.raises(OffspecError) as info:
        offspec.load(str(target), str(draft), max_context=64, max_budget=8, budget=4)
    assert "\n" not in str(info.value) and "during the warm-up" in str(info.value)


def test_bench_names_the_gpu_it_ran_on(two_gpus):
    from types import SimpleNamespace

    from offspec.cli.bench import environment

    info = SimpleNamespace(target="t", draft="d", device="cuda:1", dtype="float16", extra={})
    assert environment(SimpleNamespace(info=info))["gpu"] == "Fake GPU 1"
