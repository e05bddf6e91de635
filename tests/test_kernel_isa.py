"""The CPU kernels' instruction sets: AVX-512 (two blocks per instruction) computes the AVX2 kernels' bits, and
OFFSPEC_KERNEL_ISA picks the variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.ggml import ggml_type
from tiny_gguf import random_blocks

INTEGER = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def two_builds():
    """The kernels in use (AVX-512 where the CPU has it) and the AVX2 build of the same sources."""
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    if "-mavx512bw" not in kernels._simd_flags():
        pytest.skip("this CPU has no AVX-512 (or OFFSPEC_KERNEL_ISA=avx2): the kernels in use are the AVX2 ones")
    return kernels.compiled(), kernels.build_variant("avx2")


@pytest.mark.parametrize("type_name", INTEGER)
def test_avx512_kernels_compute_the_avx2_kernels_bits(two_builds, type_name):
    wide, avx2 = two_builds
    assert wide.isa().startswith("AVX-512") and avx2.isa() == "AVX2"
    # an odd number of blocks of 32 for the legacy types (the last block runs alone), 3 super-blocks for K-quants
    cols = 768 if type_name.endswith("_K") else 480
    rng = np.random.default_rng(7)
    raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))
    x = torch.from_numpy(rng.standard_normal((21, cols)).astype(np.float32) * 3)  # tiles of 8, 4 and the rest
    tid = ggml_type(type_name).id
    got, want = wide.qgemm(x, raw, tid, cols), avx2.qgemm(x, raw, tid, cols)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(wide.qgemm(x[5:6].clone(), raw, tid, cols), want[5:6])  # one row: the same bits too


def test_the_isa_variable_caps_the_instruction_set_and_rejects_other_values(monkeypatch):
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"})
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv(kernels.ISA_VARIABLE, raising=False)
    assert kernels._simd_flags()[-3:] == ["-mavx512f", "-mavx512bw", "-mavx512vnni"]
    monkeypatch.setenv(kernels.ISA_VARIABLE, "AVX2")
    assert kernels._simd_flags() == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv(kernels.ISA_VARIABLE, "sse")
    with pytest.raises(OffspecError, match="OFFSPEC_KERNEL_ISA=sse: use avx2"):
        kernels._simd_flags()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "avx512f"})  # no BW: AVX2 kernels
    monkeypatch.setenv(kernels.ISA_VARIABLE, "auto")
    assert kernels._simd_flags() == ["-mavx2", "-mfma", "-mf16c"]


def test_the_status_line_names_the_instruction_set():
    assert kernels.load_kernels() is None
    assert kernels.kernel_status() == f"compiled ({kernels.compiled().isa()})"
    assert kernels.compiled().isa() in ("AVX-512 VNNI", "AVX-512", "AVX2", "scalar")
