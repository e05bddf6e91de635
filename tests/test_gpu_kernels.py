"""offspec's CUDA linears (offspec/formats/gpu: Triton) computed on a CPU by Triton's interpreter, in a process of
its own (tests/helpers/gpu_interp.py):

- every type offspec computes with has a GPU decoder, and its decode equals the CPU decode (dequant.py, gguf's
  reference, the compiled kernels) bit for bit;
- every output row is bit-identical at M = 1, 3, 16, 17, 64 and 1,024 rows, through every tiling of the kernel
  (float32; bfloat16 too, the interpreter's rounding made the GPU's);
- the products equal an exact reference within the dtype's tolerance.

The same checks in bfloat16 on a GPU: tests/test_cuda_kernels.py. Where Triton is not installed (a dev dependency
on Linux x86-64) the tests say so and skip.
"""

import importlib.util

import pytest
from helpers.interpreted import interpret

from offspec import OffspecError

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")
ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0",
             "MXFP4")
# the slow checks run a family per process (its node id: e.g. [lattice-ternary]): a process per type costs seconds
FAMILIES = {"blocks-of-32": ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"),
            "super-blocks": ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"),
            "lattice-ternary": ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")}
MS = "1,3,16,17,64,1024"
# every type: the largest M only needs to be above 64 (the tilings of many rows; M is not specialized on), and each
# of its 64-row tiles decodes the weights again, which costs the interpreter minutes at 1,024 (a full tile and a
# partial one: 80 rows)
MS_EVERY_TYPE = "1,3,16,17,64,80"


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_every_types_gpu_decode_equals_the_cpu_decode_bit_for_bit(family):
    types = FAMILIES[family]
    results = interpret("decode", ",".join(types))
    assert [r["type"] for r in results] == list(types)
    for r in results:
        assert r["gguf"] and r["finite"] and r["bf16"], r  # bf16: rounded to nearest even, as torch rounds
        assert r["dequant"], r
        assert r.get("cpu_kernels", True), r  # the compiled CPU kernels' decode, where they are built
        assert r.get("edges", True), r  # MXFP4 at every exponent, subnormal and overflowing ones included


def test_every_type_offspec_computes_with_has_a_gpu_decoder():
    """No type falls back to another path on CUDA: each has its unit in blocks.py (its decode and products: the
    tests here) and, if it indexes a lattice grid, the grid's width as gguf's table has it."""
    from offspec.formats.dequant import GRID_NAMES, grid_values
    from offspec.formats.ggml import KERNEL_NAMES, ggml_type
    from offspec.formats.gpu.blocks import GRID_WIDTH, UNITS

    assert set(ALL_TYPES) == set(KERNEL_NAMES) == set(UNITS) == {t for f in FAMILIES.values() for t in f}
    assert set(GRID_WIDTH) == set(GRID_NAMES)
    for name, unit in UNITS.items():
        t = ggml_type(name)
        assert unit.values * t.nbytes == unit.nbytes * t.block and unit.chunks * 32 == unit.values, name
    for name, width in GRID_WIDTH.items():
        assert grid_values(name).shape[1] == width, name


def _check_linear(results, types, tolerance):
    assert [r["type"] for r in results] == list(types)
    for r in results:
        assert r["finite"] and r["rel_err"] < tolerance, r
        assert all(r["same"].values()), r  # every row, every M, both paths: the bits of the M = 1024 rows


@pytest.mark.slow  # 15 s under the interpreter; the quick lane runs the kernels through the layer (test_gpu_layer)
@needs_triton
def test_rows_are_bit_identical_at_every_row_count_and_path():
    types = ("Q4_K",)  # the usual type (units of 256, 2 splits here); every type: the slow tests below
    _check_linear(interpret("linear", ",".join(types), "float32", "70", "512", MS), types, 1e-6)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_type_is_batch_invariant_in_float32(family):
    types = [t for t in FAMILIES[family] if t != "Q4_K"]
    _check_linear(interpret("linear", ",".join(types), "float32", "70", "512", MS_EVERY_TYPE), types, 1e-6)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_type_is_batch_invariant_in_bfloat16(family):
    """bf16 operands, float32 sums, one rounding of the output: about 2^-9 relative."""
    types = FAMILIES[family]
    _check_linear(interpret("linear", ",".join(types), "bfloat16", "70", "512", MS_EVERY_TYPE), types, 5e-3)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_group_of_weights_of_three_types_is_one_linear_with_invariant_rows(dtype):
    """A q/k/v-like group of a K-quant and two lattice types (each launch its own grid) in one call."""
    r = interpret("group", dtype)
    assert r["rel_err"] < (1e-6 if dtype == "float32" else 5e-3), r
    assert all(r["same"].values()), r


def test_the_switch_is_checked_in_one_line(monkeypatch):
    from offspec.formats.gpu import choice

    monkeypatch.setenv(choice.VARIABLE, "cuda")
    with pytest.raises(OffspecError, match="use auto .* triton or torch"):
        choice.cuda_kernels()
    monkeypatch.setenv(choice.VARIABLE, "triton")
    monkeypatch.setattr(choice.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OffspecError, match="Triton is not installed"):
        choice.cuda_kernels()
    monkeypatch.setenv(choice.VARIABLE, "auto")
    assert choice.cuda_kernels() == "torch"  # no Triton: the torch decode path
    monkeypatch.undo()
    monkeypatch.delenv(choice.VARIABLE, raising=False)
    expected = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    assert choice.cuda_kernels() == expected  # the default


def test_splits_depend_on_the_shape_and_the_gpu_never_on_the_rows():
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu.choice import WORKSPACE_BYTES
    from offspec.formats.gpu.linear import GRID_SPLIT_ROWS, MAX_SPLIT, PLAN_BN, PROGRAMS_PER_SM, plan_splits

    q4k, q8, iq2, iq4 = (ggml_type(name).id for name in ("Q4_K", "Q8_0", "IQ2_XXS", "IQ4_NL"))
    # a 70B q projection on an H100: 128 tiles of 64 rows, 3 splits of 11 units of 256 (264 programs wanted)
    assert plan_splits(8192, 8192, [q4k], 132) == (3, 11 * 256)
    assert plan_splits(1024, 8192, [q4k], 132) == (MAX_SPLIT, 512)  # its k/v: 16 tiles, split as far as allowed
    assert plan_splits(896, 896, [q8], 24) == (4, 224)  # the 0.5B draft's q (896 = 28 units of 32)
    assert plan_splits(128, 512, [q4k, q8], 4) == (2, 256)  # a group splits at a multiple of every unit
    assert plan_splits(2048, 4096, [q4k], 132) == (8, 512)  # 9 wanted; 16 units split evenly: 8 of 2
    assert plan_splits(8192, 8192, [iq2], 132) == (3, 11 * 256)  # a 70B in IQ2: its units of 256 as Q4_K's
    assert plan_splits(128, 768, [iq4, iq2], 4) == (3, 256)  # a group of 32 and 256: at multiples of 256
    for sms in (1, 24, 132):  # enough programs for the GPU where the weight has the units
        for n, k in ((64, 256), (4096, 4096), (151936, 1536)):
            splits, per = plan_splits(n, k, [q4k], sms)
            tiles = -(-n // PLAN_BN)
            assert (splits - 1) * per < k <= splits * per and per % 256 == 0
            assert splits * tiles >= min(PROGRAMS_PER_SM * sms, tiles * (k // 256), tiles * MAX_SPLIT) // 2
    # the workspace the placement charges covers the largest partials
    assert WORKSPACE_BYTES >= GRID_SPLIT_ROWS * (PROGRAMS_PER_SM * 132 + MAX_SPLIT) * PLAN_BN * 4
