"""Modules whose weights are rows of ggml blocks: `QLinear` and `QEmbedding` (see ggml.py for the format).

Their `qweight` is a (rows, row_bytes) uint8 buffer holding the GGUF's own bytes; the offloading code binds it
as a view into a packed layer payload (resident, or a streaming slot), so no weight is ever copied into a float
tensor. `replace_linears` / `replace_embedding` swap them into a weightless transformers skeleton.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import kernels
from .ggml import KERNEL_TYPES


class QLinear(nn.Module):
    """y = x W^T + b with W (out_features, in_features) stored as ggml blocks of `type_id`; where `interleaved`,
    its rows are interleaved 16 at a time for the CPU kernels (kernels.interleave) and `kernel_type` says so;
    `sums`: a draft's weight, whose interleaved products may round differently (kernels.as_draft)."""

    def __init__(self, type_id: int, in_features: int, out_features: int, bias: bool, device: torch.device):
        super().__init__()
        self.type_id, self.in_features, self.out_features = type_id, in_features, out_features
        self.interleaved = False
        self.sums = False
        row_bytes = KERNEL_TYPES[type_id].row_bytes(in_features)
        self.register_buffer("qweight", torch.empty((out_features, row_bytes), dtype=torch.uint8, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device) if bias else None)

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take: the ggml type's, or its interleaved layout's."""
        if not self.interleaved:
            return self.type_id
        return self.type_id + (kernels.X16S_TYPES if self.sums else kernels.X16_TYPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return kernels.linear(x, self.qweight, self.kernel_type, self.in_features, bias)  # (..., out_features)

    def extra_repr(self) -> str:
        layout = (" x16 sums" if self.sums else " x16") if self.interleaved else ""
        return (f"{KERNEL_TYPES[self.type_id].name}{layout}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class QEmbedding(nn.Module):
    """Embedding rows gathered from a table of ggml blocks and decoded on the fly (only the rows asked for).

    The table may live on the host (e.g. memory-mapped from its file) while the model computes on a GPU: the
    rows are gathered where the table is and moved to `device`.

    `scale`: the factor the replaced embedding multiplies its rows by (Gemma's scaled embeddings: sqrt(hidden)),
    applied as transformers does, in the compute dtype; None: none.
    """

    def __init__(self, type_id: int, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device, scale: Optional[float] = None):
        super().__init__()
        self.type_id, self.num_embeddings, self.embedding_dim = type_id, num_embeddings, embedding_dim
        self.compute_dtype, self.compute_device = dtype, torch.device(device)
        self.scale = scale
        # the scale as a tensor where the rows are made, once (no host copy per call): () compute dtype
        self._scale = None if scale is None else \
            torch.tensor(scale, dtype=torch.float32).to(device=self.compute_device, dtype=dtype)
        row_bytes = KERNEL_TYPES[type_id].row_bytes(embedding_dim)
        self.register_buffer("qweight", torch.empty((num_embeddings, row_bytes), dtype=torch.uint8, device="meta"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.qweight.device)  # (n,)
        raw = self.qweight[flat]  # (n, row_bytes) the rows' blocks
        if self.compute_device.type == "cuda":  # the blocks cross the link (fewer bytes), decoded on the GPU
            raw = raw.to(self.compute_device)
        rows = kernels.dequantize_rows(raw, self.type_id, self.embedding_dim)  # (n, dim) float32
        rows = rows.to(device=self.compute_device, dtype=self.compute_dtype)
        if self.scale is not None:  # as Gemma's ScaledWordEmbedding: a float32 scalar cast to the rows' dtype
            rows = rows * self._scale
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale:g}"
        return f"{KERNEL_TYPES[self.type_id].name}, {self.num_embeddings}, {self.embedding_dim}{scale}"


def replace_linear(root: nn.Module, name: str, type_id: int, device: torch.device) -> QLinear:
    """Swap the nn.Linear at `name` (relative to `root`) for an empty QLinear of the same shape."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear):
        raise TypeError(f"{name} is a {type(old).__name__}, not a Linear")
    new = QLinear(type_id, old.in_features, old.out_features, old.bias is not None, device)
    setattr(parent, child, new)
    return new


def replace_embedding(root: nn.Module, name: str, type_id: int, dtype: torch.dtype,
                      device: torch.device) -> QEmbedding:
    """Swap the nn.Embedding at `name` for an empty QEmbedding computing in `dtype` on `device`."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    if not isinstance(old, nn.Embedding):
        raise TypeError(f"{name} is a {type(old).__name__}, not an Embedding")
    # Gemma's embeddings scale their rows (`scalar_embed_scale`, sqrt(hidden)): kept, or the model reads garbage
    scale = getattr(old, "scalar_embed_scale", None)
    new = QEmbedding(type_id, old.num_embeddings, old.embedding_dim, dtype, device,
                     None if scale is None else float(scale))
    setattr(parent, child, new)
    return new


def lowbit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The QLinear / QEmbedding modules of `model`, by qualified name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (QLinear, QEmbedding))]


def weight_format_summary(model: nn.Module) -> Optional[dict[str, int]]:
    """{type name: bytes} of the low-bit weights of `model`, or None when it has none."""
    out: dict[str, int] = {}
    for _, module in lowbit_modules(model):
        name = KERNEL_TYPES[module.type_id].name
        out[name] = out.get(name, 0) + module.qweight.numel()
    return out or None
