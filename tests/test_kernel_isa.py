"""The CPU kernels' instruction sets: AVX-512 (two blocks per instruction) computes the AVX2 kernels' bits, the AMX
tiles (K-quants and IQ4_XS of wide passes) compute the AVX-512 kernels' bits, the scalar K-quant kernels the AVX2
ones', and OFFSPEC_KERNEL_ISA picks the variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tiny_gguf import random_blocks

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.ggml import INTEGER_NAMES, activation_block, ggml_type
from offspec.progress import no_progress

INTEGER = INTEGER_NAMES


@pytest.fixture(scope="module")
def two_builds():
    """The kernels in use (AVX-512 where the CPU has it) and the AVX2 build of the same sources."""
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    if "-mavx512bw" not in kernels._simd_flags():
        pytest.skip("this CPU has no AVX-512 (or OFFSPEC_KERNEL_ISA=avx2): the kernels in use are the AVX2 ones")
    return kernels.compiled(), kernels.build_variant("avx2")


@pytest.mark.slow
@pytest.mark.parametrize("type_name", INTEGER)
def test_avx512_kernels_compute_the_avx2_kernels_bits(two_builds, type_name):
    wide, avx2 = two_builds
    assert "AVX-512" in wide.isa() and avx2.isa() == "AVX2"  # AMX too where the CPU has it (K-quants, 21 rows)
    # an odd number of blocks of 32 for the legacy types (the last block runs alone), 3 super-blocks for K-quants
    cols = 768 if activation_block(type_name) == 256 else 480
    rng = np.random.default_rng(7)
    raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))
    x = torch.from_numpy(rng.standard_normal((21, cols)).astype(np.float32) * 3)  # tiles of 8, 4 and the rest
    tid = ggml_type(type_name).id
    got, want = wide.qgemm(x, raw, tid, cols), avx2.qgemm(x, raw, tid, cols)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for m in (1, 2, 3, 4, 5, 7):  # the K-quants: kwtile below 8 rows; the legacy types: tiles of 4, then the rest
        assert torch.equal(wide.qgemm(x[5:5 + m].clone(), raw, tid, cols), want[5:5 + m])


@pytest.fixture(scope="module")
def no_vnni(two_builds):
    """The AVX-512 kernels as a CPU without VNNI runs them (Skylake-X): Q4_0 and Q5_0 as unsigned bytes summed by
    maddubs, Q8_0 with the sign trick."""
    flags = [f for f in kernels._simd_flags("avx512") if f != "-mavx512vnni"]
    return kernels._compile(no_progress, flags)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_0", "Q5_0", "Q8_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "IQ2_XXS",
                                       "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0",
                                       "MXFP4"))
def test_avx512_without_vnni_computes_the_same_bits(two_builds, no_vnni, type_name):
    wide, avx2 = two_builds
    assert no_vnni.isa() == "AVX-512"
    rng = np.random.default_rng(8)
    tid = ggml_type(type_name).id
    # an odd and an even number of blocks of 32 (of super-blocks of 256 for IQ4_XS, the K-quants and the lattices)
    for cols in ((480, 512) if activation_block(type_name) == 32 else (768, 512)):
        raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))
        x = torch.from_numpy(rng.standard_normal((9, cols)).astype(np.float32) * 3)
        x[2, :64] = 0.0  # activation blocks of zeros (scale 0)
        want = avx2.qgemm(x, raw, tid, cols)
        for m in (1, 2, 3, 4, 9):
            for ext in (no_vnni, wide):
                assert torch.equal(ext.qgemm(x[:m].clone(), raw, tid, cols).view(torch.int32), want[:m].view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("type_name", kernels.X16_NAMES)
def test_interleaved_rows_compute_the_same_bits_in_every_build(two_builds, no_vnni, type_name):
    """The x16 kernels (csrc/ggml_x16.h) at 8 lanes (AVX2: a group in two halves) and at 16 (AVX-512, with VNNI's
    dot products or without) compute the row-major kernels' bits; a draft's (X16S_TYPES) one result in all."""
    wide, avx2 = two_builds
    rng = np.random.default_rng(9)
    tid = ggml_type(type_name).id
    # 3 super-blocks (Q6_K's alternating layout); the legacy types: 15 blocks (an odd count, alternating too)
    cols = 768 if activation_block(type_name) == 256 else 480
    raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))  # two groups of 16, 5 rows row-major
    x = torch.from_numpy(rng.standard_normal((9, cols)).astype(np.float32) * 3)
    x[2, :64] = 0.0  # activation blocks of zeros (scale 0)
    want = avx2.qgemm(x, raw, tid, cols)
    drafts = avx2.qgemm(x, avx2.interleave(raw, tid, cols, True), tid + kernels.X16S_TYPES, cols)
    for ext in (avx2, no_vnni, wide):
        mixed = ext.interleave(raw, tid, cols, True)
        assert torch.equal(mixed, wide.interleave(raw, tid, cols, True))  # one layout for every build
        for m in (1, 2, 3, 4, 7, 9):  # tiles of 4 rows and each rest
            got = ext.qgemm(x[:m].clone(), mixed, tid + kernels.X16_TYPES, cols)
            assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), (ext.isa(), m)
        # a layer's products of one input (q/k/v, gate/up) share its quantization: the same bits, every weight
        first, second = ext.qgemm_many(x[:4].clone(), [mixed, mixed[:16].clone()], [tid + kernels.X16_TYPES] * 2, cols)
        assert torch.equal(first, want[:4]) and torch.equal(second, want[:4, :16]), ext.isa()
        # a draft's products (a block's lanes summed as integers first): one result in every build too
        sums = ext.qgemm(x, mixed, tid + kernels.X16S_TYPES, cols)
        assert torch.equal(sums.view(torch.int32), drafts.view(torch.int32)), ext.isa()
        for m in (1, 2):  # a draft's step (AVX2: both halves of a group in one walk) and its catch-up
            sums = ext.qgemm(x[:m].clone(), mixed, tid + kernels.X16S_TYPES, cols)
            assert torch.equal(sums.view(torch.int32), drafts[:m].view(torch.int32)), (ext.isa(), m)


@pytest.fixture(scope="module")
def avx2_build():
    """The AVX2 build of the kernels (on any CPU with AVX2: its own kernels, or a variant beside AVX-512's)."""
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    if kernels.compiled().isa() == "scalar":
        pytest.skip("this CPU has no AVX2: the kernels in use are the scalar ones")
    return kernels.build_variant("avx2")


@pytest.fixture(scope="module")
def scalar_build(avx2_build):
    """The kernels without SIMD, as a CPU without AVX2 builds them."""
    return kernels._compile(no_progress, [])


@pytest.mark.slow
@pytest.mark.parametrize("type_name", [name for name in INTEGER if activation_block(name) == 256])
def test_scalar_k_quant_kernels_compute_the_avx2_kernels_bits(avx2_build, scalar_build, type_name):
    """The super-block types' (K-quants, IQ4_XS, the IQ3/IQ1 lattices) sums are exact integers and their float steps
    KSteps' in every build (the legacy types' scalar kernels sum their blocks in another order)."""
    assert scalar_build.isa() == "scalar"
    rng = np.random.default_rng(12)
    tid, cols = ggml_type(type_name).id, 768
    raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))
    x = torch.from_numpy(rng.standard_normal((21, cols)).astype(np.float32) * 3)
    x[2, :256] = 0.0  # an activation block of zeros (scale 0)
    want = avx2_build.qgemm(x, raw, tid, cols)
    for m in (1, 3, 8, 21):  # the AVX2 kernels: 8 weight rows side by side below 8 rows, tiles of 8 and 4 from 8
        got = scalar_build.qgemm(x[:m].clone(), raw, tid, cols)
        assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), m


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K", "Q2_K", "Q3_K"))
def test_avx2_products_hold_the_largest_sums(avx2_build, type_name):
    """The AVX2 walks (q4k_x16_avx2, q6k_x16_avx2 and their one-row forms; q2k_x16's two chunks, q3k_x16's groups)
    sum several chunks' products in 16-bit lanes: at the largest quants, scales and activations (-128 for a negative
    block) they still compute the row-major kernels' bits, in one row and in tiles of 2, 3 and 4."""
    ext = avx2_build
    rng = np.random.default_rng(10)
    tid, cols = ggml_type(type_name).id, 768
    raw = random_blocks(rng, type_name, 32, cols).reshape(32, cols // 256, -1)  # (rows, super-blocks, bytes)
    if type_name == "Q4_K":  # d, dmin, 12 scale bytes, 128 quant bytes: every scale, min and quant at its largest
        raw[:, :, 4:] = 0xFF
    elif type_name == "Q2_K":  # 16 scale bytes, 64 quant bytes: every scale and minimum 15, every quant 3
        raw[:, :, :80] = 0xFF
    elif type_name == "Q3_K":  # hmask, quants, scales: every quant 3 and scale 31, or (odd rows) -4 and -32
        raw[::2, :, :108] = 0xFF
        raw[1::2, :, :108] = 0
    else:  # 128 ql, 64 qh (quants 63), 16 int8 scales (127 and -128 in turn), d
        raw[:, :, :192] = 0xFF
        raw[:, :, 192:208] = np.array([0x7F, 0x80] * 8, dtype=np.uint8)
    raw = torch.from_numpy(raw.reshape(32, -1).copy())
    x = torch.full((7, cols), -3.0)  # (7, cols): blocks of one negative value quantize to -128
    x[1::2] = 3.0
    x[2, 256:512] = -x[2, 256:512]
    want = ext.qgemm(x, raw, tid, cols)  # row-major
    mixed = ext.interleave(raw, tid, cols, True)
    for m in (1, 2, 3, 4, 7):
        got = ext.qgemm(x[:m].clone(), mixed, tid + kernels.X16_TYPES, cols)
        assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), m
    for r in range(3):
        one = ext.qgemm(x[r:r + 1].clone(), mixed, tid + kernels.X16_TYPES, cols)
        assert torch.equal(one.view(torch.int32), want[r:r + 1].view(torch.int32)), r


@pytest.mark.slow
@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (9, 3, 64), (4, 1, 256), (6, 1, 72)])
def test_exact_attention_computes_the_same_bits_in_every_build(two_builds, H, Hkv, D):
    """AVX-512 runs the value sums 64 elements at a time (AVX2 16, the rest one by one): the same fma chains; and the
    softmax's exponentials 16 keys at a time (AVX2 8, the rest one by one): the same operations, underflow included
    (the large scale)."""
    wide, avx2 = two_builds
    g = torch.Generator().manual_seed(H * D)
    q, k, v = (torch.randn(1, n, m, D, generator=g) for n, m in ((H, 6), (Hkv, 50), (Hkv, 50)))
    visible = torch.rand(6, 50, generator=g) < 0.7  # (Q, L) bool
    for softcap, scale in ((0.0, D ** -0.5), (50.0, D ** -0.5), (0.0, 3.0)):
        got, want = wide.attend(q, k, v, visible, scale, softcap), avx2.attend(q, k, v, visible, scale, softcap)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.fixture()
def amx():
    """The kernels in use, with the AMX tiles on; skipped (with the reason) where the build or the CPU has none."""
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    assert kernels._amx_failure is None or "unrecognized" in kernels._amx_failure, \
        f"the AMX kernels did not build: {kernels._amx_failure}"
    ext = kernels.compiled()
    if not ext.set_amx(True) and "AMX" not in ext.isa():
        pytest.skip("no AMX tiles here (the CPU lacks AMX-INT8, the OS refused them, or OFFSPEC_KERNEL_ISA caps it)")
    yield ext
    ext.set_amx(True)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
def test_amx_tiles_compute_the_avx512_kernels_bits(amx, type_name):
    rng = np.random.default_rng(11)
    tid = ggml_type(type_name).id
    # a partial group of 16 weight rows; 1, 3, 6 super-blocks; 17 (K > 4096: Q6_K's tiles from 6 rows, not 8)
    for rows, cols in ((53, 768), (16, 256), (37, 1536), (16, 4352)):
        raw = torch.from_numpy(random_blocks(rng, type_name, rows, cols))
        x = torch.from_numpy(rng.standard_normal((40, cols)).astype(np.float32) * 3)
        x[7] = 0.0  # an activation block of zeros (scale 0)
        amx.set_amx(False)
        want = amx.qgemm(x, raw, tid, cols)
        amx.set_amx(True)
        assert "AMX" in amx.isa()
        assert torch.isfinite(want).all()
        for m in (6, 7, 8, 16, 17, 40):  # tiles of 16 activation rows: whole, padded, and several
            got = amx.qgemm(x[:m].clone(), raw, tid, cols)
            assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), (rows, cols, m)
        assert torch.equal(amx.qgemm(x[9:10].clone(), raw, tid, cols), want[9:10])  # one row: AVX-512 VNNI


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


def test_amx_is_built_where_the_cpu_has_it_unless_the_isa_variable_says_avx512(monkeypatch):
    amx_cpu = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "amx_tile", "amx_int8"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: amx_cpu)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv(kernels.ISA_VARIABLE, raising=False)
    assert kernels._simd_flags()[-6:] == ["-mavx512f", "-mavx512bw", "-mavx512vnni", *kernels.AMX_FLAGS]
    monkeypatch.setenv(kernels.ISA_VARIABLE, "avx512")
    assert kernels._simd_flags()[-3:] == ["-mavx512f", "-mavx512bw", "-mavx512vnni"]
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: amx_cpu - {"amx_int8"})  # tiles without int8 products
    monkeypatch.delenv(kernels.ISA_VARIABLE)
    assert not set(kernels.AMX_FLAGS) & set(kernels._simd_flags())


def test_a_compiler_without_amx_builds_the_avx512_kernels(monkeypatch):
    built = []

    def compile_(progress, flags):
        if set(kernels.AMX_FLAGS) <= set(flags):
            raise RuntimeError("g++: error: unrecognized command-line option '-mamx-tile'")
        built.append(flags)
        return object()

    monkeypatch.setattr(kernels, "_simd_flags", lambda: ["-mavx2", "-mavx512f", *kernels.AMX_FLAGS])
    monkeypatch.setattr(kernels, "_compile", compile_)
    for name in ("_ext", "_flags", "_failure", "_amx_failure"):
        monkeypatch.setattr(kernels, name, None)
    events = []
    assert kernels.load_kernels(events.append) is None
    assert built == [["-mavx2", "-mavx512f"]] and kernels._flags == ["-mavx2", "-mavx512f"]
    said = "the CPU kernels are built without AMX (g++: error: unrecognized command-line option '-mamx-tile')"
    assert [e.message for e in events] == [said]
    assert kernels._amx_failure == "g++: error: unrecognized command-line option '-mamx-tile'"


def test_the_status_line_names_the_instruction_set():
    assert kernels.load_kernels() is None
    assert kernels.kernel_status() == f"compiled ({kernels.compiled().isa()})"
    assert kernels.compiled().isa() in ("AMX + AVX-512 VNNI", "AVX-512 VNNI", "AVX-512", "AVX2", "scalar")
