"""Quantizing a float (safetensors) model's weights once, into the same ggml block formats a GGUF uses.

`--quant int4` stores each linear weight as Q4_1 (4 bits, a scale and a minimum per block of 32) and `--quant
int8` as Q8_0 (8 bits, a scale per block of 32); the LM head and the token table become Q8_0 in both cases (the
LM head decides every token; GGUF files keep it at 6-8 bits too). The arithmetic is the gguf package's
reference quantizer, so a tensor quantized here equals what llama.cpp's converter would write. A weight whose
input size is not a multiple of 32 cannot be blocked and stays float32 (type F32 rows).
"""

from __future__ import annotations

import numpy as np
import torch

from .ggml import F32, ggml_type

LAYER_TYPES = {"int4": "Q4_1", "int8": "Q8_0"}
HEAD_TYPE = "Q8_0"  # LM head and token table


def weight_type(kind: str, cols: int, head: bool = False) -> int:
    """The ggml type id a weight of `cols` inputs is stored in under `--quant kind`."""
    t = ggml_type(HEAD_TYPE if head else LAYER_TYPES[kind])
    return t.id if cols % t.block == 0 else F32.id


def quantize_rows(weight: torch.Tensor, type_id: int) -> torch.Tensor:
    """A float (rows, cols) weight -> (rows, row_bytes) uint8 blocks of `type_id`."""
    import gguf

    values = np.ascontiguousarray(weight.detach().to("cpu", torch.float32).numpy())  # (rows, cols)
    if type_id == F32.id:
        return torch.from_numpy(values.view(np.uint8).copy())
    blocks = gguf.quantize(values, gguf.GGMLQuantizationType(type_id))  # (rows, row_bytes) uint8
    return torch.from_numpy(np.ascontiguousarray(blocks))
