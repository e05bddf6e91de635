"""The ggml block formats offspec keeps as they are, from the GGUF file to the kernel.

A quantized weight of shape (N, K) (N outputs, K inputs) is stored as N rows of `K / block` blocks of `nbytes`
bytes each: a (N, row_bytes) uint8 tensor, exactly the bytes of the GGUF file. Sizes come from the gguf
package (`GGML_QUANT_SIZES`). `KERNEL_TYPES` are the types offspec computes with directly (CPU kernels in
csrc/, torch decoders in dequant.py); a GGUF tensor of another type is decoded once at conversion and stored
as float32 (exact), with a note in the progress.
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


KERNEL_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_NAMES = ("F32", "F16", "BF16")


def ggml_type(key: int | str) -> GGMLType:
    """The type by ggml id (an int) or name ("Q4_K")."""
    qt = GGMLQuantizationType(key) if isinstance(key, int) else GGMLQuantizationType[key]
    block, nbytes = GGML_QUANT_SIZES[qt]
    return GGMLType(int(qt), qt.name, block, nbytes)


KERNEL_TYPES: dict[int, GGMLType] = {ggml_type(name).id: ggml_type(name) for name in KERNEL_NAMES}
F32 = KERNEL_TYPES[int(GGMLQuantizationType.F32)]


def has_kernel(type_id: int) -> bool:
    return type_id in KERNEL_TYPES
