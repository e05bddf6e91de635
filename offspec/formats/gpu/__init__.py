"""offspec's CUDA compute, in Triton (tested on a CPU through Triton's interpreter, `TRITON_INTERPRET=1`).

- choice.py     which compute runs on CUDA (OFFSPEC_CUDA_KERNELS, OFFSPEC_LAYERS, the model), its device memory
- blocks.py     ggml block decoders as Triton functions: 32 values at a time, the gguf reference's arithmetic
- linear.py     batch-invariant low-bit linears: one fused decode + GEMM kernel for every type and row count
                (fixed split-K), tiled by the row count; the same bits at every row count
- experts.py    a mixture's routed experts: each projection of every routed expert in one grouped launch, each
                row the bits of its expert's linear alone; the routed FFN around them
- norm.py       batch-invariant RMSNorm (with the residual add), RoPE with the KV-cache write
- attention.py  tree attention with native grouped-query heads: shared prefix tiles, then each query's own keys
- layer.py      offspec's decoder layer on CUDA (llama family), installed like formats/layers.py on a CPU
- graphs.py     CUDA graphs per (key, rows bucket): buckets, capture, replay

Every kernel computes an output row from that row's inputs alone, with a reduction order that depends neither on
the number of rows nor on the tiles, so a tree pass and the same tokens decoded one by one give the same bits
(docs/gpu-design.md). The matrix products use the tensor cores' mma.sync instructions everywhere (`DISABLE_MMA_V3`:
see linear.py), whose rows never interact.
"""
