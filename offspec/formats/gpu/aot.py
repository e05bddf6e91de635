"""offspec's Triton kernels compiled ahead of time for a card, on any machine (no GPU needed): what a launch needs
of the card, and what arithmetic it runs.

`compile_launch(launch, card)` compiles a recorded launch (launch.py: `recording`) for the card's compute
capability exactly as a real launch would: the same binder decides Triton's specializations of the actual
arguments (integers equal to 1 or divisible by 16, pointers' alignment), the same options (warps, stages, no
contraction). Triton's compiler and its bundled ptxas run on a CPU.

- `resources(kernel)`: shared memory (what Triton checks at launch against the card's limit), registers per thread
  and spilled bytes (from the cubin, read by the bundled cuobjdump), threads per block;
- `arithmetic(kernel)`: what a row's values go through, comparable between launches: each matrix product's
  operand layout (Triton's MMA version, instruction shape, element types and `kWidth`, which orders K inside an
  instruction; or FMA), its K width and precision, and the set of PTX arithmetic instructions (opcode with its
  rounding and types: `mma.sync...`, `fma.rn.f32`, `add.rn.f32`, `cvt.rn.bf16x2.f32`, ...).

Used by tests/test_gpu_aot.py (every configuration within sm_80 to sm_90's limits; one arithmetic at every row
count). On the user's card the check is the real launch, once, at load (probe.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, NamedTuple, Optional

from .launch import REGISTERS_PER_BLOCK, REGISTERS_PER_THREAD, Card, Launch

# PTX instructions that compute with values (not addresses, loads, moves or predicates)
ARITHMETIC = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:fma|add|sub|mul|div|rcp|sqrt|rsqrt|ex2|lg2|max|min|neg|abs|cvt)\.[\w.]*)")
MATRIX = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:mma|wgmma|tcgen05)\.[\w.:]*)")  # every matrix instruction
FLOAT_SUFFIX = re.compile(r"\.(?:f16|bf16|f32|f64|bf16x2|f16x2|e4m3|e5m2)\b")


class Resources(NamedTuple):
    shared: int  # bytes of dynamic shared memory (Triton's metadata.shared, checked at launch)
    registers: Optional[int]  # per thread (None: no cuobjdump to read them with)
    spilled: Optional[int]  # bytes of local memory per thread (register spills)
    threads: int

    def problems(self, gpu: Card) -> list[str]:
        """What would keep this kernel from launching on `gpu` (empty: it launches)."""
        out = []
        if self.shared > gpu.max_shared:
            out.append(f"shared memory {self.shared} B > {gpu.max_shared} B")
        if self.registers is not None:
            if self.registers > REGISTERS_PER_THREAD:
                out.append(f"{self.registers} registers per thread > {REGISTERS_PER_THREAD}")
            if self.registers * self.threads > REGISTERS_PER_BLOCK:
                out.append(f"{self.registers} registers x {self.threads} threads > {REGISTERS_PER_BLOCK}")
        return out


class Arithmetic(NamedTuple):
    dots: tuple  # each matrix product: (operand layouts, K, input precision)
    instructions: frozenset  # PTX arithmetic opcodes on floating-point values


def target(gpu: Card):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", gpu.capability, 32)


@functools.lru_cache(maxsize=None)
def _binder(kernel: Any, capability: int):
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target(Card("", capability, 0, 0)))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


_compiled: dict = {}  # this process's compiled kernels by (kernel, capability, signature, constants, options)


def compile_launch(launch: Launch, gpu: Card):
    """The CompiledKernel a real launch of `launch` on `gpu` would run (compiled once per process and key; Triton's
    own cache on disk keeps them between processes)."""
    import triton
    from triton.compiler import ASTSource

    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    backend, binder = _binder(kernel, gpu.capability)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    key = (kernel.fn.__qualname__, gpu.capability, repr(signature), repr(sorted(constexprs.items())),
           repr(sorted(attrs.items())), repr(options), os.environ.get("DISABLE_MMA_V3"), os.environ.get("DISABLE_MMA_V5"))
    if key not in _compiled:
        _compiled[key] = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target(gpu),
                                        options=options.__dict__)
    return _compiled[key]


def resources(compiled) -> Resources:
    registers, spilled = _cubin_usage(compiled.asm["cubin"], compiled.metadata.name)
    return Resources(int(compiled.metadata.shared), registers, spilled, 32 * int(compiled.metadata.num_warps))


def _cuobjdump() -> Optional[str]:
    import triton.backends.nvidia as nvidia

    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def _cubin_usage(cubin: bytes, name: str) -> tuple[Optional[int], Optional[int]]:
    """(registers per thread, local bytes per thread) of kernel `name` in a cubin."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = re.search(r"Function " + re.escape(name) + r":\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}: {out[-300:]}")
    return int(found.group(1)), int(found.group(2)) + int(found.group(3))


def arithmetic(compiled) -> Arithmetic:
    return Arithmetic(_dots(compiled.asm["ttgir"]), _instructions(compiled.asm["ptx"]))


def _dots(ttgir: str) -> tuple:
    """Each tt.dot's operand layouts with the tile's M and N and the warps' arrangement left out (a row's products
    do not depend on them with mma.sync: its rows never interact), K and the precision kept."""
    aliases = dict(re.findall(r"^(#[\w]+) = (#ttg\.[^\n]+)$", ttgir, re.MULTILINE))
    out = []
    for line in ttgir.splitlines():
        if "tt.dot " not in line and "ttng.warp_group_dot" not in line:
            continue
        precision = re.search(r"inputPrecision = (\w+)", line)
        operands = re.findall(r"tensor<(\d+)x(\d+)x(\w+), (#ttg\.dot_op<\{[^}]*\}>)>", line)
        layouts = []
        for rows, cols, elem, layout in operands[:2]:
            parent = re.search(r"parent = (#\w+)", layout).group(1)
            kwidth = re.search(r"kWidth = (\d+)", layout)
            layouts.append((elem, int(kwidth.group(1)) if kwidth else None, _parent(aliases.get(parent, parent))))
        k = int(operands[0][1]) if operands else None
        out.append((tuple(layouts), k, precision.group(1) if precision else None,
                    "warp_group" if "warp_group_dot" in line else "dot"))
    return tuple(sorted(set(out), key=repr))


def _parent(encoding: str) -> str:
    """An MMA layout without its warps (version and instruction shape kept); a blocked (FMA) layout as 'blocked'."""
    if "nvidia_mma" in encoding:
        version = re.search(r"versionMajor = (\d+), versionMinor = (\d+)", encoding)
        shape = re.search(r"instrShape = \[([\d, ]+)\]", encoding)
        return f"mma v{version.group(1)}.{version.group(2)} {shape.group(1) if shape else ''}"
    return "blocked" if "blocked" in encoding else encoding


def _instructions(ptx: str) -> frozenset:
    """The matrix instructions and float arithmetic opcodes of a PTX listing; a packed form (`cvt.rn.bf16x2.f32`:
    two values at once) is counted as its one-value form, each lane rounding the same."""
    found = set()
    for line in ptx.splitlines():
        matrix = MATRIX.match(line)
        if matrix:
            found.add(matrix.group(1))
            continue
        match = ARITHMETIC.match(line)
        if match and FLOAT_SUFFIX.search(match.group(1)):
            found.add(re.sub(r"\.(bf16|f16)x2\b", r".\1", match.group(1)))
    return frozenset(found)


def contractible(arithmetic_: Arithmetic) -> list[str]:
    """Float multiplies and adds without a rounding mode: ptxas may fuse them into an fma where it likes, so two
    kernels writing the same arithmetic could round differently (none where contraction is off)."""
    return sorted(op for op in arithmetic_.instructions
                  if re.fullmatch(r"(add|sub|mul)(\.ftz)?\.(f32|f64|f16|bf16|f16x2|bf16x2)", op))
