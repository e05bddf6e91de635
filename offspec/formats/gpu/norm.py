"""Batch-invariant RMSNorm (with the residual add before it) and the rotary embedding with the KV-cache write.

One program per row: a row's sum of squares is reduced by one program whose shape never depends on the number of
rows, so its bits are the same in a one-token pass and a tree pass. The arithmetic is transformers' (Llama / Qwen2
RMSNorm: the row in float32, x * rsqrt(mean(x^2) + eps) rounded to the dtype, times the weight in the dtype;
`apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin, each product rounded to the dtype), up to the order of the
sum of squares.
"""

from __future__ import annotations

from typing import Optional

import torch

from .blocks import triton
from .launch import launch

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _add_rms_norm(h_ptr, d_ptr, w_ptr, hout_ptr, x_ptr, E, eps, stride_h, stride_d, stride_o, stride_x,
                      BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
        """Row m: hout = h + d (rounded to the dtype), x = RMSNorm(hout) * w."""
        m = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        mask = e < E
        h = tl.load(h_ptr + m * stride_h + e, mask=mask, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(d_ptr + m * stride_d + e, mask=mask, other=0.0).to(tl.float32))
            h = h.to(hout_ptr.dtype.element_ty)
            tl.store(hout_ptr + m * stride_o + e, h, mask=mask)
        hf = h.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / E + eps)
        y = (hf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + e, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + m * stride_x + e, (w * y).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x, cos, sin, partner, D: tl.constexpr):
        """x * cos + rotate_half(x) * sin for a (R, D) tile; partner (R, D) is x at (j + D/2) % D."""
        j = tl.arange(0, D)
        rot = tl.where(j[None, :] < D // 2, -partner, partner)
        a = (x * cos).to(x.dtype).to(tl.float32)
        b = (rot * sin).to(x.dtype).to(tl.float32)
        return a + b

    @triton.jit(do_not_specialize=["cap"])
    def _rope_kv(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, stride_qkv, stride_cs, cap,
                 H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, HKVP: tl.constexpr):
        """Row m of qkv ((H + 2 HKV) * D: q heads, k heads, v heads): q rotated into q (M, H, D); k rotated and v
        as it is into the caches (HKV, cap, D) at slot slots[m]."""
        m = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, D)
        pj = (j + D // 2) % D
        cos = tl.load(cos_ptr + m * stride_cs + j).to(tl.float32)[None, :]  # (1, D)
        sin = tl.load(sin_ptr + m * stride_cs + j).to(tl.float32)[None, :]
        row = qkv_ptr + m * stride_qkv
        hq = tl.arange(0, HP)
        qm = (hq < H)[:, None]
        q = tl.load(row + hq[:, None] * D + j[None, :], mask=qm, other=0.0)  # (HP, D)
        qp = tl.load(row + hq[:, None] * D + pj[None, :], mask=qm, other=0.0)
        out = _rotate(q.to(tl.float32), cos, sin, qp.to(tl.float32), D).to(q.dtype)
        tl.store(q_ptr + (m * H + hq)[:, None] * D + j[None, :], out.to(q_ptr.dtype.element_ty), mask=qm)
        slot = tl.load(slots_ptr + m).to(tl.int64)
        hk = tl.arange(0, HKVP)
        km = (hk < HKV)[:, None]
        k = tl.load(row + (H + hk)[:, None] * D + j[None, :], mask=km, other=0.0)
        kp = tl.load(row + (H + hk)[:, None] * D + pj[None, :], mask=km, other=0.0)
        dst = (hk.to(tl.int64) * cap + slot)[:, None] * D + j[None, :]  # (HKVP, D) in (HKV, cap, D)
        tl.store(k_ptr + dst, _rotate(k.to(tl.float32), cos, sin, kp.to(tl.float32), D).to(k_ptr.dtype.element_ty),
                 mask=km)
        v = tl.load(row + (H + HKV + hk)[:, None] * D + j[None, :], mask=km, other=0.0)
        tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=km)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rms_norm(h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for h, delta (M, E); delta None: (h, RMSNorm(h) * weight)."""
    m, e = h.shape
    x = torch.empty_like(h)  # (M, E) normed
    hout = torch.empty_like(h) if delta is not None else h  # (M, E) the residual stream
    if m:
        block = _pow2(e)
        launch(_add_rms_norm, (m,), h, delta if delta is not None else h, weight, hout, x, e, float(eps), h.stride(0),
               (delta if delta is not None else h).stride(0), hout.stride(0), x.stride(0), BLOCK=block,
               HAS_DELTA=delta is not None, num_warps=8 if block >= 4096 else 4)
    return hout, x


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv (M, (heads + 2 kv_heads) * D) -> rotated queries (M, heads, D); rotated keys and the values written to the
    caches (kv_heads, capacity, D) at `slots` (M,). cos, sin (M, D)."""
    m = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((m, heads, d), dtype=qkv.dtype, device=qkv.device)  # (M, H, D)
    if m:
        assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and d & (d - 1) == 0
        launch(_rope_kv, (m,), qkv, cos, sin, slots, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
               k_cache.shape[1], H=heads, HKV=kv_heads, D=d, HP=_pow2(heads), HKVP=_pow2(kv_heads))
    return q
