"""The compute device: which one (cpu, cuda:N), its default dtype, making it current, what is free on it, what
an out-of-memory error means to the user, and the one host wait that timings use (the compute stream only).

Every CUDA call here names its device, so `--device cuda:1` never creates a context on GPU 0.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from offspec.errors import OffspecError

from .sizes import format_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
BF16_CAPABILITY = (8, 0)  # Ampere and newer: bfloat16 tensor-core GEMMs and fused attention kernels


def resolve_device(name: Optional[str]) -> torch.device:
    """`name` (None = cuda when available, else cpu) as a device with an index on CUDA ("cuda" = the current GPU)."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise OffspecError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise OffspecError(f"device {name!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OffspecError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise OffspecError(f"device {name} does not exist: this machine has {count} CUDA GPU(s), "
                               f"cuda:0 to cuda:{count - 1}")
        device = torch.device("cuda", index)
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU; on CUDA bfloat16 from compute capability 8.0 (Ampere) on, float16 below it (Turing, Volta,
    Pascal: no bfloat16 GEMMs, and attention falls back to the math kernel)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if tuple(torch.cuda.get_device_capability(device)) >= BF16_CAPABILITY else torch.float16


def resolve_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    if name not in DTYPES:
        raise OffspecError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return DTYPES[name]


def use_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this thread (allocations, events and streams without an explicit
    device, and the CUDA context that pinned host memory is registered in, go there). On a machine without CUDA:
    `cpu_only_imports`."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not torch.cuda.is_available():
        cpu_only_imports()


def cpu_only_imports() -> None:
    """Where no CUDA device exists, torch._dynamo's import-time probe for Triton (`has_triton_package`, which
    transformers' model classes reach) answers no instead of importing it: Triton's library is 120 MB of pages a
    memory budget of 1 GB would hold for nothing (it only compiles GPU kernels). offspec's own Triton code imports
    it by name and is unaffected. Once dynamo is imported, its answer is kept: then this does nothing."""
    import sys

    if "torch._dynamo" in sys.modules:
        return
    import torch.utils._triton as probe

    probe.has_triton_package = lambda: False


def sync_compute(device: torch.device) -> None:
    """Host waits for the work queued on `device`'s compute (current) stream. Not the whole device: the layer
    streamer's copy stream keeps loading the next pass's layers meanwhile."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # sync: the compute stream only, never the copy stream


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device as offspec could use them now: what the driver reports free plus what
    PyTorch's allocator holds unused (it hands that out first)."""
    free, total = torch.cuda.mem_get_info(device)  # sync-free driver query
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached)), int(total)


def check_device_budget(device: torch.device, budget: Optional[int]) -> None:
    """Refuse (one line) a --device-mem above what the CUDA device has free now; nothing to check on CPU."""
    if budget is None or device.type != "cuda":
        return
    free, total = free_memory(device)
    if budget > free:
        fits = max(0, free - 256 * 10**6) // 10**8 / 10  # GB, one decimal, a little under what is free
        raise OffspecError(
            f"--device-mem {format_size(budget)} is more than the {format_size(free)} free on {device} "
            f"({device_name(device)}, {format_size(total)}; the desktop, other programs and the CUDA context use "
            f"the rest); use --device-mem {fits:g}GB or less, or leave it out to take what is free")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or \
        (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))  # the CPU allocator's wording


def out_of_memory_error(exc: BaseException, device: torch.device, when: str, budget: Optional[int]) -> OffspecError:
    """One line for an out-of-memory error `when` ("loading the models", "the warm-up"): what was asked, what to do."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]i?B)", str(exc))
    what = f" (it tried to allocate {asked[1]})" if asked else ""
    where = "device memory" if device.type == "cuda" else "memory"
    used = f"the device budget was {format_size(budget)}; " if budget else ""
    return OffspecError(f"out of {where} on {device} during {when}{what}; {used}lower --device-mem, --max-context "
                        f"or --max-budget, or close what else uses the {'GPU' if device.type == 'cuda' else 'RAM'}")
