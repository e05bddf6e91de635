"""The compute behind low-bit weights: `linear` and `gather` for rows of ggml blocks, chosen per device.

- CPU: the compiled kernels of csrc/ (integer dot products on 8-bit activation blocks, AVX2 where the CPU has it),
  built once per machine with torch.utils.cpp_extension into the cache dir (about a minute; progress is shown).
  Their results are row invariant: a one-token pass and a tree pass give bitwise identical rows.
- CUDA: offspec's Triton kernels (gpu/linear.py: batch-invariant, every type), or where Triton is missing or
  `OFFSPEC_CUDA_KERNELS=torch` asks (gpu/choice.py), the torch path below.
- a CPU where the kernels cannot be built (no C++ compiler), and CUDA's torch path: the blocks are decoded with
  torch (dequant.py) into the compute dtype, then a plain matrix multiply. On a CPU this fallback is much slower
  and is announced, never silent; `OFFSPEC_KERNELS=torch` forces it (tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.paths import kernels_dir

from .dequant import GRID_NAMES, grid_values
from .dequant import dequantize as torch_dequantize
from .ggml import ggml_type
from .gpu.choice import cuda_kernels
from .kernel_builds import MARKER, mark_used, prune_stale_builds

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ggml_cpu.cpp", "ggml_decode.h", "ggml_decode_iq.h", "ggml_decode_mxfp4.h", "ggml_dot.h", "ggml_dot_low.h",
           "ggml_dot_iq2.h", "ggml_dot_iq3.h", "ggml_dot_iq1.h", "ggml_dot_tq.h", "ggml_dot512.h", "ggml_amx.h",
           "ggml_x16.h", "ggml_x16_vec.h", "ggml_x16_legacy.h", "ggml_x16_low.h", "attention.h", "layer.h",
           "layer_stack.h", "experts.h")
# "avx2": build without AVX-512 on a CPU that has it; "avx512": without AMX (the results are the same)
ISA_VARIABLE = "OFFSPEC_KERNEL_ISA"
# "rows": keep resident weights row-major instead of interleaving them (an A/B switch; the same results)
LAYOUT_VARIABLE = "OFFSPEC_CPU_LAYOUT"
X16_TYPES = 100  # an interleaved layout's type id: its ggml type's + 100 (csrc/ggml_x16.h)
# the same layout in a draft's products: the legacy types' block lanes summed as integers first, then one float step
# per block (csrc/ggml_x16_legacy.h legacy_x16s: 1.1x at 2 rows, 1.5-2.5x from 3; not the row-major kernels' bits)
X16S_TYPES = 200
# "exact": a draft's products keep the row-major kernels' bits too (an A/B switch; the same tokens either way)
DRAFT_PRODUCTS_VARIABLE = "OFFSPEC_DRAFT_PRODUCTS"
# the types with an interleaved layout
X16_NAMES = ("Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "MXFP4")
AMX_FLAGS = ["-mavx512vbmi", "-mamx-tile", "-mamx-int8"]

_lock = threading.Lock()
_ext: Any = None
_flags: Optional[list[str]] = None  # the compiler flags of the kernels in use
_amx_failure: Optional[str] = None  # why the kernels were built without AMX on a CPU that has it
_failure: Optional[str] = None  # why the CPU kernels are unavailable (then the torch fallback runs)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _simd_flags(isa: Optional[str] = None) -> list[str]:
    """Compiler flags for this CPU: AVX2 + FMA where torch finds AVX2, AVX-512 (BW; VNNI where present) on top
    unless `isa` (default: $OFFSPEC_KERNEL_ISA) is "avx2", and the AMX tiles (with VBMI and VNNI) where the CPU has
    them unless it is "avx512" too. Every variant computes the same bits (ggml_dot512.h, ggml_amx.h)."""
    choice = (os.environ.get(ISA_VARIABLE, "") if isa is None else isa).strip().lower() or "auto"
    if choice not in ("auto", "avx2", "avx512"):
        raise OffspecError(f"{ISA_VARIABLE}={choice}: use avx2 (no AVX-512 in the CPU kernels), avx512 (no AMX) "
                           f"or auto")
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return []
    flags = ["-mavx2", "-mfma", "-mf16c"]
    cpu = _cpu_flags()
    if choice != "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX512" and {"avx512f", "avx512bw"} <= cpu:
        flags += ["-mavx512f", "-mavx512bw"] + (["-mavx512vnni"] if "avx512_vnni" in cpu else [])
        if choice == "auto" and {"avx512_vnni", "avx512vbmi", "amx_tile", "amx_int8"} <= cpu:
            flags += AMX_FLAGS
    return flags


def _source_id(flags: list[str]) -> str:
    """What the kernels compute and how fast: their sources, compiler flags, torch and Python versions."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(flags + [torch.__version__, platform.python_version()]).encode())
    return h.hexdigest()[:12]


def _build_id(flags: list[str]) -> str:
    """The build directory's name: the source id and the sources' place (torch writes it into the build file, and
    two checkouts sharing one build dir would rebuild it in turn, one rewriting the library another loads)."""
    return hashlib.sha256(f"{_source_id(flags)} {CSRC.resolve()}".encode()).hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold an exclusive flock on the build directory while torch builds or loads the kernels there. torch's own
    lock (a `lock` file it creates, waits for, then deletes) outlives a build that was killed (a kernel build
    started under a small memory cgroup: the compiler needs about 2 GB), and every later start then waits for it
    forever. flock is let go when its process dies: whoever holds it is the only builder, so a `lock` file found
    then is a dead build's and goes."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; torch's lock file alone
        yield
        return
    with open(directory / "offspec-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits for a live builder, never for a dead one
        stale = directory / "lock"  # torch.utils.file_baton.FileBaton's
        if stale.exists():
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(progress: ProgressFn, flags: list[str]) -> Any:
    from torch.utils.cpp_extension import load

    build_id = _build_id(flags)
    directory = kernels_dir() / f"ggml-cpu-{build_id}"
    directory.mkdir(parents=True, exist_ok=True)
    done_marker = directory / MARKER
    message = "building the CPU kernels for this machine (one time, about a minute)"
    if not done_marker.exists():
        progress(ProgressEvent("kernels", message))
    cflags = ["-O3", "-ffp-contract=off", *flags]
    with _build_lock(directory):
        try:
            ext = load(f"offspec_ggml_{build_id}", [str(CSRC / "ggml_cpu.cpp")], extra_include_paths=[str(CSRC)],
                       extra_cflags=cflags + ["-fopenmp"], extra_ldflags=["-fopenmp"],
                       build_directory=str(directory), verbose=False)
        except Exception:  # a compiler without OpenMP (Apple clang): serial kernels
            ext = load(f"offspec_ggml_{build_id}", [str(CSRC / "ggml_cpu.cpp")], extra_include_paths=[str(CSRC)],
                       extra_cflags=cflags, build_directory=str(directory), verbose=False)
    if not done_marker.exists():
        done_marker.write_text(build_id)
        progress(ProgressEvent("kernels", message, finished=True))
        pruned = prune_stale_builds(kernels_dir(), directory)  # an upgrade's new build: the old ones may go
        if pruned.removed or pruned.failed:
            progress(ProgressEvent("kernels", pruned.message(), finished=True))
    else:
        mark_used(directory)
    for name in GRID_NAMES:  # the IQ types' lattice grids: gguf's own tables, handed to the decoders once
        ext.set_grid(ggml_type(name).id, torch.from_numpy(grid_values(name)).to(torch.int8))
    return ext


def load_kernels(progress: ProgressFn = no_progress) -> Optional[str]:
    """Build (once) and load the CPU kernels. Returns None when they are ready, else why the torch fallback runs
    (also reported as a progress event, so the user sees it)."""
    global _ext, _flags, _failure, _amx_failure
    with _lock:
        if _ext is not None or _failure is not None:
            return _failure
        if os.environ.get("OFFSPEC_KERNELS", "").strip().lower() == "torch":
            _failure = "OFFSPEC_KERNELS=torch"
        else:
            flags = _simd_flags()  # a bad OFFSPEC_KERNEL_ISA: one line, before building anything
            try:
                try:
                    _ext = _compile(progress, flags)
                except Exception as exc:
                    if not set(AMX_FLAGS) <= set(flags):
                        raise
                    # e.g. a compiler without AMX: the AVX-512 kernels (the same results), and the user is told
                    _amx_failure = _last_line(exc)
                    progress(ProgressEvent("kernels", f"the CPU kernels are built without AMX ({_amx_failure})",
                                           finished=True))
                    flags = [f for f in flags if f not in AMX_FLAGS]
                    _ext = _compile(progress, flags)
                _flags = flags
            except Exception as exc:  # no compiler, no Python headers, ...: announced, then the slow path
                _failure = f"cannot build them ({_last_line(exc)})"
        if _failure is not None:
            progress(ProgressEvent("kernels", f"the CPU kernels are unavailable: {_failure}; low-bit weights use "
                                              f"torch's much slower decoding path", finished=True))
        return _failure


def _last_line(exc: Exception) -> str:
    """What went wrong, in one line: the compiler's last word (an error's message ends with it)."""
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def build_variant(isa: str, progress: ProgressFn = no_progress) -> Any:
    """The kernels built for `isa` ("avx2", "avx512" or "auto"), beside the ones in use (tests compare their bits)."""
    return _compile(progress, _simd_flags(isa))


def compiled() -> Any:
    """The compiled CPU kernels (built or loaded on first use), or None when the torch fallback runs."""
    if _ext is None and _failure is None:
        load_kernels()
    return _ext


def kernel_build() -> str:
    """What computes low-bit weights on a CPU, for profile fingerprints: "compiled <build id>" (the sources,
    flags and torch version: new kernels mean new timings; not where they are installed) or "torch" (the
    fallback)."""
    if compiled() is None:
        return "torch"
    return f"compiled {_source_id(_flags)}"


def kernel_status() -> str:
    """One line: which CPU kernels run ("compiled (AVX-512 VNNI)", "compiled (AVX2)", "compiled (scalar)", or the
    fallback and why)."""
    if _ext is None and _failure is None:
        load_kernels()
    if _ext is not None:
        return f"compiled ({_ext.isa()}{'; AMX: ' + _amx_failure if _amx_failure else ''})"
    return f"torch fallback: {_failure}"


def linear(x: torch.Tensor, qweight: torch.Tensor, type_id: int, cols: int,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., cols) @ W^T (+ bias), W given as (rows, row_bytes) ggml blocks -> (..., rows) in x's dtype."""
    lead, rows = x.shape[:-1], qweight.shape[0]
    x2d = x.reshape(-1, cols)  # (M, cols)
    if x.device.type == "cpu":
        if _ext is None and _failure is None:
            load_kernels()
        if _ext is not None:
            y = _ext.qgemm(x2d.float().contiguous(), qweight, type_id, cols)  # (M, rows) float32
            if bias is not None:
                y += bias
            return y.reshape(*lead, rows).to(x.dtype)
        return _decoded_linear(x2d.float(), qweight, type_id, cols, bias).reshape(*lead, rows).to(x.dtype)
    # CUDA: offspec's batch-invariant Triton linears, else (no Triton, or OFFSPEC_CUDA_KERNELS=torch) decode into
    # the compute dtype, then the GPU's GEMM
    if cuda_kernels() == "triton":
        from .gpu import linear as gpu_linear  # imported here: a CPU never loads Triton

        return gpu_linear.linear(x2d, [(qweight, type_id)], cols, bias).reshape(*lead, rows)
    return _decoded_linear(x2d, qweight, type_id, cols, bias).reshape(*lead, rows)


DECODE_CHUNK_BYTES = 32 * 2**20  # float32 bytes of weight decoded at a time
# what one decoded band costs at its peak (the float32 band, the decoder's intermediates, the compute-dtype copy):
# the placement charges it where weights are decoded by torch (CUDA, or a CPU without the compiled kernels)
DECODE_WORKSPACE = 4 * DECODE_CHUNK_BYTES


def _decoded_linear(x2d: torch.Tensor, qweight: torch.Tensor, type_id: int, cols: int,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x2d (M, cols) @ W^T with W decoded by torch a band of rows at a time (the temporaries stay within
    DECODE_CHUNK_BYTES of float32 plus the decoder's own intermediates, even for an LM head)."""
    rows = qweight.shape[0]
    band = max(1, DECODE_CHUNK_BYTES // (4 * cols))
    if band >= rows:  # one band (every linear of a layer, in practice): no output buffer to copy into
        y = x2d @ torch_dequantize(qweight, type_id, cols).to(x2d.dtype).t()  # (M, rows)
        return y + bias.to(y.dtype) if bias is not None else y
    y = x2d.new_empty((x2d.shape[0], rows))  # (M, rows)
    for r0 in range(0, rows, band):
        w = torch_dequantize(qweight[r0:r0 + band], type_id, cols).to(x2d.dtype)  # (band, cols)
        y[:, r0:r0 + band] = x2d @ w.t()  # (M, band)
    if bias is not None:
        y += bias.to(y.dtype)
    return y


def dequantize_rows(raw: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """(R, row_bytes) blocks -> (R, cols) float32 on raw's device (embedding gathers)."""
    if raw.device.type == "cpu":
        if _ext is None and _failure is None:
            load_kernels()
        if _ext is not None:
            return _ext.dequantize(raw.contiguous(), type_id, cols)
    elif raw.device.type == "cuda" and cuda_kernels() == "triton":
        from .gpu import linear as gpu_linear  # imported here: a CPU never loads Triton

        return gpu_linear.decode(raw, type_id, cols, torch.float32)  # one kernel, the same exact values
    return torch_dequantize(raw, type_id, cols)


def interleaves() -> bool:
    """Whether resident weights of the X16_NAMES types get their rows interleaved for this CPU's kernels
    (csrc/ggml_x16.h: AVX2 or AVX-512 builds), unless OFFSPEC_CPU_LAYOUT=rows asks to keep them row-major."""
    choice = os.environ.get(LAYOUT_VARIABLE, "").strip().lower() or "auto"
    if choice not in ("auto", "rows"):
        raise OffspecError(f"{LAYOUT_VARIABLE}={choice}: use rows (row-major weights) or auto")
    ext = compiled()
    return choice == "auto" and ext is not None and ext.isa() != "scalar"


def interleave(module: Any) -> bool:
    """Interleave the rows of a CPU-resident QLinear 16 at a time, in place (its bytes permuted: the same size),
    where the compiled kernels compute that layout (X16_NAMES; `interleaves()`); returns whether it did. A decoding
    step reads every weight once, and this layout reads it about 2x faster on one core (ggml_x16.h); the results are
    the same bits."""
    if (module.interleaved or module.qweight.device.type != "cpu" or module.qweight.is_meta
            or ggml_type(module.type_id).name not in X16_NAMES or module.out_features < 16 or not interleaves()):
        return False
    w = module.qweight
    w.copy_(compiled().interleave(w.contiguous(), module.type_id, module.in_features, True))
    module.interleaved = True
    return True


def draft_sums() -> bool:
    """Whether a draft's interleaved weights take X16S_TYPES' products, unless OFFSPEC_DRAFT_PRODUCTS=exact."""
    choice = os.environ.get(DRAFT_PRODUCTS_VARIABLE, "").strip().lower() or "auto"
    if choice not in ("auto", "exact"):
        raise OffspecError(f"{DRAFT_PRODUCTS_VARIABLE}={choice}: use exact (the row-major kernels' bits) or auto")
    return choice == "auto"


def as_draft(model: Any) -> int:
    """Mark a draft model's QLinears so that their interleaved products sum a block's lanes as integers first
    (X16S_TYPES: a draft only proposes, so a float rounding apart costs nothing of the output); returns how many."""
    if not draft_sums():
        return 0
    marked = 0
    for module in model.modules():
        if hasattr(module, "interleaved") and hasattr(module, "sums"):
            module.sums = True
            marked += 1
    return marked


def stored_rows(module: Any) -> torch.Tensor:
    """A QLinear's weight rows as stored (row-major ggml blocks, `module.type_id`): its qweight, or a row-major copy
    where its rows are interleaved (`interleave`)."""
    if not module.interleaved:
        return module.qweight
    return compiled().interleave(module.qweight.contiguous(), module.type_id, module.in_features, False)
