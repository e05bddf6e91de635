"""offspec's CUDA linears on a GPU (`pytest -m cuda`): tests/test_gpu_kernels.py's checks on the real thing, in
bfloat16 (the CUDA default) and float32.

- each type's decode on the GPU equals gguf's reference decode bit for bit (float32), and its bfloat16 rounding
  (the lattice types' grids read from a device tensor, linear.lattice);
- every output row is bit-identical at M = 1, 3, 16, 17, 64 and 1,024 rows, through every tiling (rows_hint), for
  every type, on a small shape and on a 70B-sized one (real split-K);
- the products run on mma.sync (never wgmma: the rows of a tile must not interact), and QLinear uses them.
Skipped, with the reason shown, where there is no CUDA GPU or no Triton.
"""


import numpy as np
import pytest
import torch
from helpers.gpu_device import GPU, cuda_marks

pytestmark = cuda_marks(triton=True)
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0",
         "MXFP4")
MS = (1, 3, 16, 17, 64, 1024)


def _helpers():
    from helpers import gpu_interp  # blocks(), reference(), same_bits(): no interpreter set-up at import

    return gpu_interp


@pytest.mark.parametrize("name", TYPES)
def test_the_gpu_decode_equals_the_reference_decode_bit_for_bit(name):
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    h = _helpers()
    raw = h.blocks(np.random.default_rng(0), name, 300, 1024)
    ref = h.reference(raw, name, 1024)
    tid = ggml_type(name).id
    got = gl.decode(raw.to(GPU), tid, 1024, torch.float32)
    torch.cuda.synchronize(GPU)
    assert h.same_bits(got.cpu(), ref)
    assert h.same_bits(gl.decode(raw.to(GPU), tid, 1024, torch.bfloat16).cpu(), ref.to(torch.bfloat16))


def _invariance(name: str, rows: int, cols: int, dtype: torch.dtype, tolerance: float):
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    h = _helpers()
    rng = np.random.default_rng(1)
    raw = h.blocks(rng, name, rows, cols).to(GPU)
    tid = ggml_type(name).id
    w = h.reference(raw.cpu(), name, cols)  # (rows, cols) float32
    bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32)).to(GPU, dtype)
    x = torch.from_numpy(rng.standard_normal((max(MS), cols)).astype(np.float32)).to(GPU, dtype)
    full = torch.full((max(MS), rows), float("nan"), dtype=dtype, device=GPU)
    full.copy_(gl.linear(x, [(raw, tid)], cols, bias))  # (1024, rows): tiles of 64 rows, the splits in programs
    exact = x.cpu().double() @ w.to(dtype).double().T + bias.cpu().double()
    err = float((full.cpu().double() - exact).norm() / exact.norm())
    assert torch.isfinite(full).all() and err < tolerance, (name, err)
    for m in MS:
        for hint in (1, gl.GRID_SPLIT_ROWS, 10**6):  # tiles of 16 rows, of 64 with the splits as programs, in programs
            got = gl.linear(x[:m], [(raw, tid)], cols, bias, rows_hint=hint)
            assert h.same_bits(got.cpu(), full[:m].cpu()), (name, m, hint)


@pytest.mark.parametrize("name", TYPES)
def test_rows_are_bit_identical_at_every_row_count_in_bfloat16(name):
    _invariance(name, 300, 1024, torch.bfloat16, 5e-3)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ2_XXS", "IQ1_M"])
def test_rows_are_bit_identical_on_70b_shapes_with_real_splits(name):
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    splits, _ = gl.plan_splits(1024, 8192, [ggml_type(name).id], gl.multiprocessors(GPU))
    assert splits > 1  # a 70B k/v projection splits K on any GPU of more than a few SMs
    _invariance(name, 1024, 8192, torch.bfloat16, 5e-3)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "F16", "IQ3_S", "TQ1_0"])
def test_rows_are_bit_identical_in_float32(name):
    _invariance(name, 300, 1024, torch.float32, 1e-5)


def test_the_products_run_on_mma_sync_never_wgmma():
    """Hopper's wgmma would be chosen for tiles of 64 rows and more unless DISABLE_MMA_V3 is set (launch.py sets it):
    nothing promises that it rounds a row as mma.sync does, so no tiling may use it. The kernels compiled here, for
    this card, are the ones that run: 1 and 1,024 rows of a Q4_K linear."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    cols, rows = 1024, 256
    raw = _helpers().blocks(np.random.default_rng(2), "Q4_K", rows, cols).to(GPU)
    for m in (1, 1024):
        gl.linear(torch.randn(m, cols, device=GPU, dtype=torch.bfloat16), [(raw, ggml_type("Q4_K").id)], cols)
    torch.cuda.synchronize(GPU)
    compiled = [k for cache in gl._fused.device_caches.values() for k in cache[0].values()]
    assert compiled
    for kernel in compiled:
        ptx = kernel.asm["ptx"]
        assert "mma.sync" in ptx and "wgmma" not in ptx


def test_a_group_of_weights_of_three_types_keeps_the_bits_on_the_gpu():
    """A q/k/v-like group in one call (a K-quant and two lattice types: three launches, each with its own grid)
    keeps each row's bits at every row count, and computes the product of the group's exact weights."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    h = _helpers()
    rng = np.random.default_rng(3)
    spec = [("Q4_K", 2048), ("IQ2_XXS", 256), ("IQ3_S", 256)]
    raws = [h.blocks(rng, n, r, 2048) for n, r in spec]
    weights = [(raw.to(GPU), ggml_type(n).id) for raw, (n, _) in zip(raws, spec)]
    x = torch.randn(200, 2048, device=GPU, dtype=torch.bfloat16)
    full = gl.linear(x, weights, 2048)
    for m in (1, 5, 33, 64, 200):
        assert torch.equal(gl.linear(x[:m], weights, 2048), full[:m])
    w = torch.cat([h.reference(raw, n, 2048) for raw, (n, _) in zip(raws, spec)])  # (2560, 2048) float32
    exact = x.cpu().double() @ w.to(torch.bfloat16).double().T
    assert float((full.cpu().double() - exact).norm() / exact.norm()) < 5e-3


def test_qlinear_on_cuda_runs_offspecs_kernels(monkeypatch):
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl
    from offspec.formats.modules import QLinear

    monkeypatch.delenv("OFFSPEC_CUDA_KERNELS", raising=False)
    module = QLinear(ggml_type("Q4_K").id, 512, 64, bias=True, device=GPU)
    module.qweight.copy_(_helpers().blocks(np.random.default_rng(4), "Q4_K", 64, 512).to(GPU))
    module.bias.normal_()
    calls = []
    real = gl.linear
    monkeypatch.setattr(gl, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    x = torch.randn(3, 7, 512, device=GPU, dtype=torch.bfloat16)
    y = module(x)
    assert y.shape == (3, 7, 64) and y.dtype == torch.bfloat16 and calls == [(21, 512)]
