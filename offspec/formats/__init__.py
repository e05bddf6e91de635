"""Weight formats and their kernels: what conversion, loading and offloading all use.

- ggml.py         the ggml block types offspec keeps as they are (a GGUF's Q4_K stays Q4_K)
- dequant.py      decoding blocks with torch, on any device (exact: the gguf package's arithmetic)
- kernels.py      the compute: compiled CPU kernels (csrc/, built once per machine), gpu/ on CUDA, torch as fallback
- gpu/            offspec's CUDA compute in Triton: batch-invariant linears, decoder layer, tree attention, graphs
- attention.py    exact attention for the target's passes (csrc/attention.h): row-invariant like the kernels
- modules.py      QLinear / QEmbedding: modules whose weights are rows of blocks
- quantize.py     float weights quantized once (--quant int4 / int8) into the same block formats
- gguf_import.py  a GGUF file -> offspec's weight store, block for block
"""
