"""Triton's interpreter (TRITON_INTERPRET=1) with a matrix product whose rounding depends on nothing but the row.

The interpreter computes `tl.dot` with numpy's matmul, and numpy's BLAS picks its kernel by shape and memory layout:
a (16, 32) @ (32, 64)^T view rounds differently from the first 16 rows of a (32, 32) one. The GPU's mma.sync never
does (its rows never interact), and that is what offspec's kernels rely on. `use_row_invariant_dot()` replaces the
interpreter's product with a k-ordered float32 chain, acc + a[:, k] * b[k, :] for k = 0, 1, ..., that reads
bfloat16 operands as the numbers they are (the interpreter keeps them as uint16 bits, and its own product multiplies
those bits as integers). It also rounds float32 to bfloat16 to nearest even, as `.to(tl.bfloat16)` does on a GPU
(the interpreter truncates). Call it in the process that runs the kernels, after `import triton`.
"""

from __future__ import annotations

import numpy as np


def _f32(handle) -> np.ndarray:
    import triton.language as tl

    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:  # stored as the uint16 bits
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (torch's rounding, the GPU's)."""
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return flat.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def use_row_invariant_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_to_bf16_bits(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    for name in ("create_fp_trunc", "create_fp_ext"):
        setattr(interpreter.InterpreterBuilder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return self.cast_impl(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        lhs, rhs = _f32(a), _f32(b)  # (..., M, K), (..., K, N)
        acc = d.data.astype(np.float32).copy()  # (..., M, N)
        for k in range(lhs.shape[-1]):
            acc += lhs[..., :, k : k + 1] * rhs[..., k : k + 1, :]
        return interpreter.TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
