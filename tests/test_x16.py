"""Weights interleaved 16 rows at a time for the CPU kernels (csrc/ggml_x16.h: Q4_K, Q6_K, Q2_K and Q3_K
(ggml_x16_low.h) and the legacy types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, ggml_x16_legacy.h): the same bytes
permuted, computing the row-major kernels' bits for any number of activation rows; resident CPU layers get the
layout at load (formats.kernels.interleave), streamed layers keep their rows. The AVX2 build's kernels are checked
against these in test_kernel_isa.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tiny_gguf import random_blocks

from offspec.errors import OffspecError
from offspec.formats import kernels
from offspec.formats.ggml import ggml_type
from offspec.formats.modules import QLinear


@pytest.fixture(scope="module")
def ext():
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    if kernels.compiled().isa() == "scalar":
        pytest.skip("the interleaved layout needs the AVX2 kernels; this build is scalar")
    return kernels.compiled()


def check_layout(ext, type_name: str, rows: int, cols: int, seed: int) -> None:
    """Interleaving is a permutation of the rows' bytes, undone exactly, and the kernels' products and decoding
    of the interleaved rows are the row-major ones' bits for every number of activation rows."""
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(random_blocks(rng, type_name, rows, cols))  # (rows, row_bytes) uint8
    tid = ggml_type(type_name).id
    mixed = ext.interleave(raw, tid, cols, True)
    assert mixed.shape == raw.shape and torch.equal(ext.interleave(mixed, tid, cols, False), raw)
    assert torch.equal(mixed[rows // 16 * 16:], raw[rows // 16 * 16:])  # the rows past the last group of 16
    if rows >= 16:
        assert not torch.equal(mixed[:16], raw[:16])
        if type_name in ("Q5_0", "Q5_1"):  # the same bytes, but for the fifth bits permuted within each qh word
            bits = torch.tensor([bin(i).count("1") for i in range(256)])
            assert bits[mixed.flatten().long()].sum() == bits[raw.flatten().long()].sum()
        else:
            assert torch.equal(mixed.flatten().sort().values, raw.flatten().sort().values)  # the same bytes
    assert torch.equal(ext.dequantize(mixed, tid + kernels.X16_TYPES, cols), ext.dequantize(raw, tid, cols))
    x = torch.from_numpy(rng.standard_normal((21, cols)).astype(np.float32) * 3)  # (21, cols)
    x[2, :256] = 0.0  # an activation block of zeros (scale 0)
    want = ext.qgemm(x, raw, tid, cols)  # (21, rows)
    assert torch.isfinite(want).all()
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 21):  # tiles of 4 activation rows, then the rest
        got = ext.qgemm(x[:m].clone(), mixed, tid + kernels.X16_TYPES, cols)
        assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32)), m


K_QUANTS = ("Q4_K", "Q6_K", "Q2_K", "Q3_K")
LEGACY = tuple(name for name in kernels.X16_NAMES if name not in K_QUANTS)


@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("cols", (256, 512, 768))  # 1, 2, 3 super-blocks: Q6_K's and Q3_K's layouts alternate
def test_interleaved_rows_compute_the_row_major_bits(ext, type_name, cols):
    check_layout(ext, type_name, 37, cols, seed=cols)  # two groups of 16 and 5 rows left row-major


@pytest.mark.parametrize("type_name", LEGACY)
# 1, 3 and 28 blocks of 32 (the 0.5B draft's rows): odd counts end on an even block, and where a group block is
# not whole cache lines the layout alternates between blocks
@pytest.mark.parametrize("cols", (32, 96, 896))
def test_interleaved_legacy_rows_compute_the_row_major_bits(ext, type_name, cols):
    check_layout(ext, type_name, 37, cols, seed=cols)


def test_q5_fifth_bits_are_permuted_within_a_row_and_back(ext):
    """A Q5_0 row's qh word is stored with bit 8j + c holding element 4c + j's fifth bit (ggml_x16.h)."""
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(random_blocks(rng, "Q5_0", 16, 32))  # (16, 22): one group, one block
    mixed = ext.interleave(raw, ggml_type("Q5_0").id, 32, True)
    for r in (0, 7, 15):
        file_bits = int.from_bytes(bytes(raw[r, 2:6].tolist()), "little")
        at = 256 + 4 * r  # block 0 is even: the quants (256 bytes), then the 16 rows' qh words
        mixed_bits = int.from_bytes(bytes(mixed.flatten()[at:at + 4].tolist()), "little")
        for c in range(8):
            for j in range(4):
                assert (mixed_bits >> (8 * j + c)) & 1 == (file_bits >> (4 * c + j)) & 1


@pytest.mark.parametrize("rows", (5, 16))
def test_weights_of_one_group_or_none_interleave_too(ext, rows):
    for type_name in kernels.X16_NAMES:
        check_layout(ext, type_name, rows, 512, seed=rows)


def test_only_the_types_with_a_kernel_interleave(ext):
    raw = torch.from_numpy(random_blocks(np.random.default_rng(0), "Q5_K", 16, 256))
    with pytest.raises(RuntimeError, match="only Q2_K, Q3_K, Q4_K, Q6_K and the legacy types"):
        ext.interleave(raw, ggml_type("Q5_K").id, 256, True)


def _qlinear(type_name: str, rows: int, cols: int, seed: int = 1) -> QLinear:
    rng = np.random.default_rng(seed)
    module = QLinear(ggml_type(type_name).id, cols, rows, bias=True, device=torch.device("cpu"))
    module.qweight.copy_(torch.from_numpy(random_blocks(rng, type_name, rows, cols)))
    module.bias.copy_(torch.from_numpy(rng.standard_normal(rows).astype(np.float32)))
    return module


def test_a_qlinear_is_interleaved_in_place_once_and_computes_the_same(ext):
    module = _qlinear("Q6_K", 48, 512)
    x = torch.randn(3, 512)  # (3, 512)
    want = module(x)
    where = module.qweight.data_ptr()
    assert kernels.interleave(module)
    assert module.interleaved and module.kernel_type == module.type_id + kernels.X16_TYPES
    assert module.qweight.data_ptr() == where  # the same buffer (a resident layer's mapped pages)
    assert torch.equal(module(x), want)
    assert not kernels.interleave(module)  # once only
    assert "Q6_K x16" in repr(module)


def test_other_types_and_weights_under_16_rows_stay_row_major(ext):
    assert kernels.interleave(_qlinear("Q8_0", 64, 256))
    assert not kernels.interleave(_qlinear("Q8_0", 15, 256))
    assert not kernels.interleave(_qlinear("F16", 64, 256))
    assert not kernels.interleave(_qlinear("Q4_K", 8, 256))
    assert not kernels.interleave(_qlinear("Q5_K", 64, 256))


def test_the_layout_variable_keeps_rows_or_is_refused(ext, monkeypatch):
    monkeypatch.setenv(kernels.LAYOUT_VARIABLE, "rows")
    module = _qlinear("Q4_K", 32, 256)
    assert not kernels.interleave(module) and not module.interleaved
    monkeypatch.setenv(kernels.LAYOUT_VARIABLE, "columns")
    with pytest.raises(OffspecError, match="OFFSPEC_CPU_LAYOUT=columns: use rows"):
        kernels.interleave(module)


def _block_sums_reference(ext, type_name: str, raw: torch.Tensor, x: np.ndarray, cols: int) -> np.ndarray:
    """What a draft's products (X16S_TYPES) compute, for integer activations whose every block of 32 holds a +-127
    (their scale is then 1 and they quantize to themselves): per weight row, in block order, acc = fma(the block's
    integer sum of q x, d, acc) in float32 (and for Q4_1 / Q5_1 off = fma(m, the block's sum of x, off); acc + off).
    float64 holds each product exactly, so one rounding to float32 is the fma's."""
    rows, nb = raw.shape[0], cols // 32
    blocks = raw.numpy().reshape(rows, nb, -1)
    if type_name == "MXFP4":  # an E8M0 exponent: 2**(e - 128) (random_blocks' are normal floats)
        d = np.ldexp(np.float32(1), blocks[:, :, 0].astype(np.int32) - 128).astype(np.float32)  # (rows, nb)
    else:
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, nb)
    has_min = type_name in ("Q4_1", "Q5_1")
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else np.zeros_like(d)
    w = ext.dequantize(raw, ggml_type(type_name).id, cols).numpy().reshape(rows, nb, 32).astype(np.float64)
    q = np.rint((w - m[..., None]) / d[..., None]).astype(np.int64)  # (rows, nb, 32) the blocks' integers
    xb = x.reshape(x.shape[0], nb, 32).astype(np.int64)  # (M, nb, 32)
    isum = np.einsum("rbj,mbj->mrb", q, xb)  # (M, rows, nb) exact
    xsum = xb.sum(-1).astype(np.float32)  # (M, nb)
    acc = np.zeros((x.shape[0], rows), np.float32)
    off = np.zeros_like(acc)
    for b in range(nb):
        acc = (isum[:, :, b] * d[None, :, b].astype(np.float64) + acc).astype(np.float32)
        if has_min:
            off = (m[None, :, b].astype(np.float64) * xsum[:, None, b] + off).astype(np.float32)
    return acc + off if has_min else acc


@pytest.mark.parametrize("type_name", kernels.X16_NAMES)
def test_a_drafts_products_sum_each_blocks_lanes_as_integers_first(ext, type_name):
    """X16S_TYPES (a draft's weights, kernels.as_draft): the legacy types' products take one float step per block
    (the reference above), the same bits for a row at any number of activation rows (tiles of 8, 4, 2, 1) and in
    qgemm_many; close to the exact kernels' but not their bits. The K-quants' are the x16 products."""
    rng = np.random.default_rng(11)
    cols = 512 if type_name in K_QUANTS else 896
    raw = torch.from_numpy(random_blocks(rng, type_name, 37, cols))  # two groups of 16, 5 rows row-major
    if type_name == "MXFP4":  # exponents 2**-20 .. 2**3: with random_blocks' 3 powers of 2 every float sum here is
        # exact, the draft's and the exact kernels' alike, and the two would not differ
        raw.view(37, -1, 17)[:, :, 0] = torch.from_numpy(rng.integers(108, 132, (37, cols // 32)).astype(np.uint8))
    tid = ggml_type(type_name).id
    mixed = ext.interleave(raw, tid, cols, True)
    x = rng.integers(-127, 128, (21, cols)).astype(np.float32)  # (21, cols)
    x[:, ::32] = 127.0  # every block's scale 1
    x[3, 32:64] = 0.0  # a block of zeros
    xt = torch.from_numpy(x)
    got = ext.qgemm(xt, mixed, tid + kernels.X16S_TYPES, cols)  # (21, 37)
    exact = ext.qgemm(xt, raw, tid, cols)
    if type_name in K_QUANTS:
        assert torch.equal(got, exact)
    else:
        want = _block_sums_reference(ext, type_name, raw, x, cols)
        assert np.array_equal(got[:, :32].numpy().view(np.int32), want[:, :32].view(np.int32))
        assert torch.equal(got[:, 32:], exact[:, 32:])  # the rows past the last group: the row-major kernels
        assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
        assert not torch.equal(got, exact)
    for m in range(1, 21):  # tiles of 8 (AVX2: 4), then a tile of the rest
        assert torch.equal(ext.qgemm(xt[:m].clone(), mixed, tid + kernels.X16S_TYPES, cols), got[:m]), m
    pair = ext.qgemm_many(xt[:6].clone(), [mixed, mixed[:16].clone()], [tid + kernels.X16S_TYPES] * 2, cols)
    assert torch.equal(pair[0], got[:6]) and torch.equal(pair[1], got[:6, :16])


def test_a_draft_is_marked_for_its_products_unless_asked_exact(ext, monkeypatch):
    modules = torch.nn.Sequential(_qlinear("Q5_0", 32, 896), _qlinear("Q4_K", 32, 256), _qlinear("Q8_0", 8, 896))
    for module in modules:
        kernels.interleave(module)
    monkeypatch.setenv(kernels.DRAFT_PRODUCTS_VARIABLE, "exact")
    assert kernels.as_draft(modules) == 0 and modules[0].kernel_type == modules[0].type_id + kernels.X16_TYPES
    monkeypatch.setenv(kernels.DRAFT_PRODUCTS_VARIABLE, "fast")
    with pytest.raises(OffspecError, match="OFFSPEC_DRAFT_PRODUCTS=fast: use exact"):
        kernels.as_draft(modules)
    monkeypatch.delenv(kernels.DRAFT_PRODUCTS_VARIABLE)
    x = torch.randn(3, 896)  # (3, 896)
    exact = modules[0](x)
    assert kernels.as_draft(modules) == 3
    assert [m.kernel_type for m in modules] == [modules[0].type_id + kernels.X16S_TYPES,
                                                modules[1].type_id + kernels.X16S_TYPES, modules[2].type_id]
    assert "Q5_0 x16 sums" in repr(modules[0])
    assert torch.allclose(modules[0](x), exact, rtol=1e-4, atol=1e-4)


def _interleaved(ext, rng, names, rows, cols):
    """Random weights of `names` (`rows` rows each): their interleaved layouts, x16 type ids and (raw, type id)."""
    weights, types, plain = [], [], []
    for name, n in zip(names, rows):
        raw = torch.from_numpy(random_blocks(rng, name, n, cols))  # (n, row_bytes) uint8
        tid = ggml_type(name).id
        weights.append(ext.interleave(raw, tid, cols, True))
        types.append(tid + kernels.X16_TYPES)
        plain.append((raw, tid))
    return weights, types, plain


@pytest.mark.parametrize("names, cols", [
    (("Q4_K", "Q4_K", "Q6_K"), 512),  # the 1.5B target's q, k, v: one quantization of the input for all three
    (("Q5_0", "Q5_0"), 96),  # the 0.5B draft's gate and up
    (("Q5_0", "Q5_0", "Q8_0"), 96),  # a draft layer's q, k, v: Q8_0's lanes take another offset, one qgemm each
    (("Q4_K", "Q5_0"), 512),  # activation blocks of 256 and of 32
    (("MXFP4", "MXFP4", "Q8_0"), 96),  # gpt-oss's experts' gate and up (MXFP4's lanes: another offset again)
])
def test_products_of_one_input_by_several_weights_are_each_weights_bits(ext, names, cols):
    """qgemm_many (a layer's q/k/v and gate/up) gives each weight qgemm's bits, whether the weights share the
    quantized input and one fork (the same activation format) or not, at every number of activation rows; weights
    of whole groups, one group and none, and rows past the last group."""
    rng = np.random.default_rng(len(names) * cols)
    rows = (37, 16, 5, 48)[:len(names)]
    weights, types, plain = _interleaved(ext, rng, names, rows, cols)
    x = torch.from_numpy(rng.standard_normal((9, cols)).astype(np.float32) * 3)  # (9, cols)
    for m in (1, 2, 4, 5, 9):
        got = ext.qgemm_many(x[:m].clone(), weights, types, cols)
        assert len(got) == len(names)
        for y, (raw, tid), n in zip(got, plain, rows):
            want = ext.qgemm(x[:m].clone(), raw, tid, cols)  # (m, n)
            assert y.shape == (m, n) and torch.equal(y.view(torch.int32), want.view(torch.int32)), (m, n)
    assert [y.shape for y in ext.qgemm_many(x[:0].clone(), weights, types, cols)] == [(0, n) for n in rows]


@pytest.mark.parametrize("threads", (1, 2, 3))
def test_products_are_the_same_bits_whatever_the_threads_and_their_chunks(ext, threads):
    """x16_gemm hands its 16-row groups to the threads in chunks as they come free (ggml_cpu.cpp shared_for: about
    a twelfth of a thread's share): a chunk ending inside a weight, one straddling two weights of qgemm_many and a
    last partial chunk give every row the bits of one activation row through the row-major kernels."""
    rng = np.random.default_rng(threads)
    cols = 512
    names, rows = ("Q3_K", "Q3_K", "Q4_K"), (16 * 61 + 3, 16 * 25, 16 * 7 + 9)  # 61 + 25 + 7 groups, chunks of 1-3
    weights, types, plain = _interleaved(ext, rng, names, rows, cols)
    x = torch.from_numpy(rng.standard_normal((9, cols)).astype(np.float32) * 3)  # (9, cols)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = {m: ext.qgemm_many(x[:m].clone(), weights, types, cols) for m in (1, 9)}
        alone = ext.qgemm(x[:9].clone(), weights[0], types[0], cols)
    finally:
        torch.set_num_threads(before)
    for i, (raw, tid) in enumerate(plain):
        want = torch.cat([ext.qgemm(x[m:m + 1].clone(), raw, tid, cols) for m in range(9)])  # (9, n), one row each
        for m, ys in got.items():
            assert torch.equal(ys[i].view(torch.int32), want[:m].view(torch.int32)), (i, m)
    assert torch.equal(alone.view(torch.int32), got[9][0].view(torch.int32))


def test_a_loaded_pairs_draft_takes_the_drafts_products_and_the_output_stays_the_targets(tmp_path, monkeypatch):
    """offspec.load marks the draft's QLinears (kernels.as_draft) and never the target's; model-drafted replies
    equal the target's own greedy ones, whichever products the draft takes."""
    import offspec
    from helpers.tiny_gguf import save_tiny_gguf

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    legacy = {"linear": "Q5_0", "down": "Q8_0", "v": "Q8_0", "output": "Q8_0"}  # the 0.5B draft's kinds
    target = save_tiny_gguf(tmp_path / "t.gguf", "qwen2", seed=0, layers=3, types=legacy)
    draft = save_tiny_gguf(tmp_path / "d.gguf", "qwen2", seed=0, layers=3, types=legacy, noise=0.002)
    replies = {}
    for mode in ("auto", "exact"):
        monkeypatch.setenv(kernels.DRAFT_PRODUCTS_VARIABLE, mode)
        gen = offspec.load(str(target), str(draft), max_context=128, max_budget=16)
        drafts = [m for m in gen.engine.drafter.runner.model.modules() if isinstance(m, QLinear)]
        targets = [m for m in gen.engine.target.model.modules() if isinstance(m, QLinear)]
        assert drafts and targets and not any(m.sums for m in targets)
        assert all(m.sums for m in drafts) == (mode == "auto")
        if mode == "auto":
            assert any(m.kernel_type >= kernels.X16S_TYPES for m in drafts if m.interleaved)
        plain = gen.generate("Hello there", max_new_tokens=16, speculate=False).token_ids
        assert gen.generate("Hello there", max_new_tokens=16, budget=8, drafter="model").token_ids == plain
        replies[mode] = plain
    assert replies["auto"] == replies["exact"]
