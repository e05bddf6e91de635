"""offspec's CUDA decoder layer (offspec/formats/gpu/layer.py) computed on a CPU by Triton's interpreter
(tests/helpers/gpu_interp.py, tests/helpers/gpu_layer_checks.py), on a tiny random llama-family layer with ggml
block weights of a Q4_K_M-like mix:

- against transformers' layer (eager attention, the same decoded weights): a prefill pass and a tree pass, their
  outputs and the keys and values they write, within float32 rounding; in bfloat16 no further from transformers'
  float32 layer than transformers' own bfloat16 layer is;
- row invariance: each node of a tree equals, bit for bit, the same token decoded alone after its ancestors were
  committed (output and cache entries), with the attention's chunk boundaries falling differently in the two; a
  prefill in one pass equals one in two chunks.

The same checks run on a GPU in tests/test_cuda_layer.py.
"""

import importlib.util

import pytest
from helpers.interpreted import interpret

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")


@needs_triton
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])  # qwen2: q/k/v biases
def test_the_layer_computes_what_transformers_layer_computes_in_float32(arch):
    r = interpret("hf", arch, "float32")
    assert all(r[k] < 1e-5 for k in ("prefill", "tree", "keys", "values")), r


@needs_triton
@pytest.mark.slow
def test_the_layer_in_bfloat16_is_as_close_to_float32_as_transformers_is():
    r = interpret("hf", "qwen2", "bfloat16")
    for name in ("prefill", "tree"):
        assert r[name + "_ours"] <= 1.25 * r[name + "_theirs"] + 1e-3, r
    assert r["keys"] < 1e-2 and r["values"] < 1e-2, r


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_node_equals_the_token_decoded_alone_bit_for_bit(dtype):
    r = interpret("invariance", dtype)
    assert r["finite"] and r["chunked_prefill"], r
    assert all(r["alone"]) and all(r["cache"]) and len(r["alone"]) == 6, r


@needs_triton
@pytest.mark.slow
def test_a_models_body_runs_the_installed_layers_as_the_runner_calls_it():
    """The install's plumbing (transformers' body calling the patched layers and final norm with the runner's cache
    and the pass's TailKeys) against transformers' own body with the float weights."""
    r = interpret("model", "qwen2")
    assert r["installed"] and all(r[k] < 1e-5 for k in ("prefill", "tree", "keys")), r
