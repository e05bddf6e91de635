"""Fused ggml-block matrix multiplies for CUDA, in Triton: the blocks are decoded in registers, tile by tile, and
multiplied at once, so a weight costs one kernel instead of the ~25 small kernels (and float32 copies of the whole
weight) of the torch decode path (dequant.py). Q4_K, Q6_K, Q5_0 and Q8_0: the types of the default pair's linears
(Q4_K_M files); other types keep the torch path.

Experimental: off unless `OFFSPEC_CUDA_KERNELS=triton`. The arithmetic is checked on a CPU through Triton's
interpreter (tests/test_gpu_kernels.py); speed and the compiled code have not yet run on a GPU
(scripts/gpu/decode_bench.py measures them). Each weight's values are decoded with
dequant.py's formulas in float32 (the GPU compiler may fuse a multiply and a subtract, so a value can differ from
dequant.py's in its last bit), then rounded to the activations' dtype for the tensor-core product, as the torch
path rounds them; the sums' order differs from cuBLAS's. A row's result does not depend on the other rows of the
batch (fixed tiles), so a one-token pass and a tree pass agree on it.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from offspec.errors import OffspecError

from .ggml import KERNEL_TYPES

VARIABLE = "OFFSPEC_CUDA_KERNELS"
BM, BN = 16, 64  # the output tile: activation rows x weight rows (tl.dot needs at least 16 of each)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path (wanted() says so where it is asked for)
    triton = None


def wanted() -> bool:
    """Whether `OFFSPEC_CUDA_KERNELS` asks for these kernels (default: the torch decode path)."""
    return _wanted(os.environ.get(VARIABLE, ""))


@functools.lru_cache(maxsize=4)
def _wanted(value: str) -> bool:
    choice = value.strip().lower() or "torch"
    if choice not in ("torch", "triton"):
        raise OffspecError(f"{VARIABLE}={choice}: use torch (decode with torch, then matmul) or triton")
    if choice == "triton" and triton is None:
        raise OffspecError(f"{VARIABLE}=triton but Triton is not installed: `pip install triton`, or unset it")
    return choice == "triton"


if triton is not None:
    @triton.jit
    def _half(ptr, mask):
        """Little-endian float16 at ptr (per lane) -> float32."""
        low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        bits = low | (tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16) << 8)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _tiles(M, N, BM: tl.constexpr, BN: tl.constexpr):
        """This program's activation rows (BM,) and weight rows (BN,), with their in-range masks."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)  # (BM,)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)  # (BN,)
        return rm, rn, rm < M, rn < N

    @triton.jit
    def _accumulate(acc, x_ptr, rm, mmask, stride_xm, k0, w, IEEE: tl.constexpr):
        """acc (BM, BN) + x[rm, k0:k0 + 32] @ w^T, w (BN, 32) the decoded float32 values: rounded to the
        activations' dtype for the tensor cores, or (IEEE: float32 activations) multiplied in float32 as torch
        does (no TF32)."""
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + tl.arange(0, 32))[None, :], mask=mmask[:, None],
                     other=0.0)  # (BM, 32)
        if IEEE:
            acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
        return acc

    @triton.jit
    def _store(y_ptr, acc, rm, rn, mmask, nmask, stride_ym):
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _q4_k_matmul(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                     BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        """y (M, N) = x (M, K) @ W^T, W (N, K / 256 * 144) Q4_K blocks: per 256 values d, dmin (fp16), 12 bytes of
        six-bit scales and minimums for 8 sub-blocks of 32, 128 bytes of nibbles (sub-blocks 2i, 2i+1 share 32
        bytes: low nibbles, then high)."""
        rm, rn, mmask, nmask = _tiles(M, N, BM, BN)
        c32 = tl.arange(0, 32)  # (32,)
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN)
        row = w_ptr + rn.to(tl.int64) * row_bytes  # (BN,) each weight row's first block
        for kb in range(0, K // 256):
            blk = row + kb * 144  # (BN,)
            d = _half(blk, nmask)  # (BN,)
            dmin = _half(blk + 2, nmask)
            for j in tl.static_range(8):
                if j < 4:
                    sc = tl.load(blk + 4 + j, mask=nmask, other=0) & 63
                    mn = tl.load(blk + 8 + j, mask=nmask, other=0) & 63
                else:
                    md = tl.load(blk + 8 + j, mask=nmask, other=0)  # scales[j + 4]
                    sc = (md & 15) | ((tl.load(blk + j, mask=nmask, other=0) >> 6) << 4)
                    mn = (md >> 4) | ((tl.load(blk + 4 + j, mask=nmask, other=0) >> 6) << 4)
                ds = d * sc.to(tl.float32)  # (BN,)
                dm = dmin * mn.to(tl.float32)
                q = tl.load(blk[:, None] + 16 + 32 * (j // 2) + c32[None, :], mask=nmask[:, None], other=0)
                q = (q >> (4 * (j % 2))) & 15  # (BN, 32)
                w = ds[:, None] * q.to(tl.float32) - dm[:, None]  # (BN, 32) as dequant.py computes it
                acc = _accumulate(acc, x_ptr, rm, mmask, stride_xm, kb * 256 + j * 32, w, IEEE)
        _store(y_ptr, acc, rm, rn, mmask, nmask, stride_ym)

    @triton.jit
    def _q6_k_matmul(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                     BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        """The same for Q6_K: per 256 values 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one
        per 16 values), d (fp16); value = d * scale * (q - 32)."""
        rm, rn, mmask, nmask = _tiles(M, N, BM, BN)
        c32 = tl.arange(0, 32)  # (32,)
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN)
        row = w_ptr + rn.to(tl.int64) * row_bytes  # (BN,)
        for kb in range(0, K // 256):
            blk = row + kb * 210  # (BN,)
            d = _half(blk + 208, nmask)  # (BN,)
            for c in tl.static_range(8):  # 32 values: half c // 4, quarter c % 4 of it
                h, r = c // 4, c % 4
                lo = tl.load(blk[:, None] + h * 64 + (r % 2) * 32 + c32[None, :], mask=nmask[:, None], other=0)
                hi = tl.load(blk[:, None] + 128 + h * 32 + c32[None, :], mask=nmask[:, None], other=0)
                q = ((lo >> (4 * (r // 2))) & 15) | (((hi >> (2 * r)) & 3) << 4)  # (BN, 32) 0..63
                s0 = tl.load(blk + 192 + 2 * c, mask=nmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                s1 = tl.load(blk + 193 + 2 * c, mask=nmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                scale = tl.where(c32[None, :] < 16, (d * s0)[:, None], (d * s1)[:, None])  # (BN, 32)
                w = scale * (q.to(tl.int32) - 32).to(tl.float32)  # (BN, 32)
                acc = _accumulate(acc, x_ptr, rm, mmask, stride_xm, kb * 256 + c * 32, w, IEEE)
        _store(y_ptr, acc, rm, rn, mmask, nmask, stride_ym)

    @triton.jit
    def _q32_matmul(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, FIVE: tl.constexpr):
        """The same for blocks of 32 values: Q8_0 (d fp16, 32 int8; value = q * d) and, FIVE, Q5_0 (d fp16, 4 bytes
        of fifth bits, 16 bytes of nibbles: low nibbles are values 0-15, high 16-31; value = d * (q - 16))."""
        rm, rn, mmask, nmask = _tiles(M, N, BM, BN)
        c32 = tl.arange(0, 32)  # (32,)
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN)
        row = w_ptr + rn.to(tl.int64) * row_bytes  # (BN,)
        for kb in range(0, K // 32):
            if FIVE:
                blk = row + kb * 22  # (BN,)
                d = _half(blk, nmask)  # (BN,)
                qh = tl.load(blk + 2, mask=nmask, other=0).to(tl.uint32)
                qh = qh | (tl.load(blk + 3, mask=nmask, other=0).to(tl.uint32) << 8)
                qh = qh | (tl.load(blk + 4, mask=nmask, other=0).to(tl.uint32) << 16)
                qh = qh | (tl.load(blk + 5, mask=nmask, other=0).to(tl.uint32) << 24)  # (BN,) bit i: value i
                nib = tl.load(blk[:, None] + 6 + (c32 % 16)[None, :], mask=nmask[:, None], other=0)  # (BN, 32)
                q = ((nib >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15).to(tl.uint32)
                q = q | (((qh[:, None] >> c32.to(tl.uint32)[None, :]) & 1) << 4)  # (BN, 32) 0..31
                w = d[:, None] * (q.to(tl.int32) - 16).to(tl.float32)  # (BN, 32)
            else:
                blk = row + kb * 34  # (BN,)
                d = _half(blk, nmask)  # (BN,)
                q = tl.load(blk[:, None] + 2 + c32[None, :], mask=nmask[:, None], other=0).to(tl.int8, bitcast=True)
                w = q.to(tl.float32) * d[:, None]  # (BN, 32)
            acc = _accumulate(acc, x_ptr, rm, mmask, stride_xm, kb * 32, w, IEEE)
        _store(y_ptr, acc, rm, rn, mmask, nmask, stride_ym)

    _SOURCES = {"Q4_K": _q4_k_matmul, "Q6_K": _q6_k_matmul, "Q8_0": _q32_matmul, "Q5_0": _q32_matmul}
else:
    _SOURCES = {}


def handles(type_id: int) -> bool:
    """Whether a fused kernel exists for this ggml type (and Triton is installed)."""
    return KERNEL_TYPES[type_id].name in _SOURCES


def linear(x2d: torch.Tensor, qweight: torch.Tensor, type_id: int, cols: int,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2d (M, cols) @ W^T (+ bias), W (rows, row_bytes) ggml blocks -> (M, rows) in x2d's dtype. On CUDA
    tensors; on CPU tensors where Triton was imported with TRITON_INTERPRET=1 (its interpreter: the tests)."""
    x2d, qweight = x2d.contiguous(), qweight.contiguous()  # rows of x and of blocks are read at fixed strides
    rows = qweight.shape[0]
    y = torch.empty((x2d.shape[0], rows), dtype=x2d.dtype, device=x2d.device)  # (M, rows)
    if x2d.shape[0] == 0:
        return y
    grid = (triton.cdiv(x2d.shape[0], BM), triton.cdiv(rows, BN))
    name = KERNEL_TYPES[type_id].name
    extra = {"FIVE": name == "Q5_0"} if name in ("Q5_0", "Q8_0") else {}
    _SOURCES[name][grid](x2d, qweight, y, x2d.shape[0], rows, cols, qweight.shape[1], x2d.stride(0), y.stride(0),
                         BM=BM, BN=BN, IEEE=x2d.dtype == torch.float32, **extra)
    return y + bias.to(y.dtype) if bias is not None else y
