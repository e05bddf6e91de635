"""Where offspec's Triton kernels launch, and what the card allows them (no Triton import here).

- `Card`: what a kernel's tiles depend on: the compute capability, the multiprocessors and the shared memory one
  block may take. `card(device)` reads it from the GPU (Triton's driver: the opt-in per-block maximum, which torch
  does not report); on a CPU (Triton's interpreter, tests) it is a small pretend card.
- `launch(kernel, grid, *args, **kwargs)`: every launch of offspec's kernels goes through here. Every launch is
  compiled with floating-point contraction off (`enable_fp_fusion=False`): each multiply and add in a kernel rounds
  as it is written, so two kernels that write the same arithmetic compute the same bits (with contraction on, the
  PTX assembler fuses a multiply and an add where it likes, differently in different kernels).
- `recording(card)`: inside it, launches are recorded (kernel, grid, arguments) instead of run, and `card()` answers
  with the given card: the exact launches a call would make on that card, for compiling them ahead of time
  (aot.py: resources, and the arithmetic each row goes through).
"""

from __future__ import annotations

import contextvars
import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch

# the matrix products' instruction: mma.sync on every card (linear.py, attention.py: its rows never interact; Hopper's
# wgmma and Blackwell's tcgen05 would be chosen for larger tiles, and nothing promises they round a row alike).
# Triton reads these when it compiles (they are part of its cache key), so they are set before any offspec kernel
# compiles: every kernel module launches through here.
os.environ["DISABLE_MMA_V3"] = "1"
os.environ["DISABLE_MMA_V5"] = "1"

REGISTERS_PER_BLOCK = 65536  # every NVIDIA card from sm_50 on
REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class Card:
    name: str
    capability: int  # 80 for sm_80
    sms: int  # multiprocessors
    max_shared: int  # bytes of shared memory one block may take (the opt-in maximum)


# the cards offspec's kernels are checked for ahead of time (tests/test_gpu_aot.py); shared memory: CUDA's
# per-block opt-in maximum of each compute capability
CARDS = {
    "sm_80": Card("A100", 80, 108, 166912),
    "sm_86": Card("RTX 3090", 86, 82, 101376),
    "sm_89": Card("RTX 4090", 89, 128, 101376),
    "sm_90": Card("H100", 90, 132, 232448),
}
SHARED_BY_CAPABILITY = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
INTERPRETER = Card("Triton's interpreter", 0, 4, 101376)  # a small "GPU": small weights split K too


class Launch(NamedTuple):
    kernel: Any  # a triton.JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


_recorder: contextvars.ContextVar = contextvars.ContextVar("offspec_gpu_recorder", default=None)


@contextmanager
def recording(card: Card) -> Iterator[list[Launch]]:
    """Record the launches made inside (nothing runs), with `card()` answering `card`."""
    launches: list[Launch] = []
    token = _recorder.set((card, launches))
    try:
        yield launches
    finally:
        _recorder.reset(token)


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    kwargs = dict(kwargs, enable_fp_fusion=False)
    recorder = _recorder.get()
    if recorder is not None:
        recorder[1].append(Launch(kernel, tuple(grid), args, kwargs))
        return
    _run(Launch(kernel, tuple(grid), args, kwargs))


def _run(launch_: Launch) -> None:
    """Triton compiles the kernel for these arguments at its first launch, checks it against the card (shared
    memory, registers: OutOfResources) and runs it (tests replace this to inject a card's refusal)."""
    launch_.kernel[launch_.grid](*launch_.args, **launch_.kwargs)


def card(device: torch.device) -> Card:
    """The card kernels for `device` are tiled for (the recorder's inside `recording`)."""
    recorder = _recorder.get()
    if recorder is not None:
        return recorder[0]
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_card(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_card(index: int) -> Card:
    props = torch.cuda.get_device_properties(index)
    capability = props.major * 10 + props.minor
    try:  # the opt-in maximum, as Triton checks a launch against it
        from triton.runtime import driver

        shared = int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except (ImportError, AttributeError, KeyError, RuntimeError):  # no such query in this Triton: CUDA's maximum
        shared = SHARED_BY_CAPABILITY.get(capability, min(SHARED_BY_CAPABILITY.values()))
    return Card(props.name, capability, int(props.multi_processor_count), shared)
