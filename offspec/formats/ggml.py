"""The ggml block formats offspec keeps as they are, from the GGUF file to the kernel.

A quantized weight of shape (N, K) (N outputs, K inputs) is stored as N rows of `K / block` blocks of `nbytes`
bytes each: a (N, row_bytes) uint8 tensor, exactly the bytes of the GGUF file. Sizes come from the gguf
package (`GGML_QUANT_SIZES`). `KERNEL_TYPES` are the types offspec computes with directly, every one kept as
blocks (docs/formats.md has the table):
- `INTEGER_NAMES`: CPU kernels with integer dot products on activations quantized to 8 bits per block of
  `activation_block(name)` (csrc/ggml_dot.h);
- the others: an exact decode of each weight row at use (csrc/ggml_decode.h, ggml_decode_iq.h), then a float32 dot
  product in a fixed order (the float types).
torch decoders (dequant.py) cover every type too (CUDA, and a CPU without the compiled kernels). A GGUF tensor of
any other type is refused at conversion (gguf_import.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block: int  # elements per block
    nbytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` elements (`cols` must be a multiple of the block)."""
        if cols % self.block:
            raise ValueError(f"{self.name} rows need a multiple of {self.block} elements, got {cols}")
        return cols // self.block * self.nbytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.block


KERNEL_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0",
                "TQ2_0", "MXFP4")
FLOAT_NAMES = ("F32", "F16", "BF16")
INTEGER_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                 "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4")


def activation_block(name: str) -> int:
    """The block of activations the integer kernel of type `name` quantizes to 8 bits with one scale: 256 for the
    types of 256-element super-blocks (ggml's Q8_K), else 32 (Q8_0)."""
    return 256 if name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                           "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0") else 32


def ggml_type(key: int | str) -> GGMLType:
    """The type by ggml id (an int) or name ("Q4_K")."""
    qt = GGMLQuantizationType(key) if isinstance(key, int) else GGMLQuantizationType[key]
    block, nbytes = GGML_QUANT_SIZES[qt]
    return GGMLType(int(qt), qt.name, block, nbytes)


KERNEL_TYPES: dict[int, GGMLType] = {ggml_type(name).id: ggml_type(name) for name in KERNEL_NAMES}
F32 = KERNEL_TYPES[int(GGMLQuantizationType.F32)]


def has_kernel(type_id: int) -> bool:
    return type_id in KERNEL_TYPES
