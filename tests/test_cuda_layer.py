"""offspec's CUDA decoder layer on a GPU (`pytest -m cuda`), and losslessness end to end in bfloat16:

- the layer against transformers' layer (tests/helpers/gpu_layer_checks.py), float32 and bfloat16;
- a tree node equals the same token decoded alone, bit for bit, with the attention's chunk of 16 keys and of its
  default size;
- a CUDA graph's replay (padded to a rows bucket) equals the eager call, bit for bit;
- greedy speculative decoding equals the target alone, token for token, in bfloat16, on a tiny GGUF pair: budgets
  1 to 1,024, several turns of one conversation (the cache reused between them), the target resident and streamed.
Skipped, with the reason shown, where there is no CUDA GPU or no Triton.
"""

import re

import pytest
import torch
from helpers.gpu_device import GPU, cuda_marks

import offspec
from offspec import OffspecError

pytestmark = cuda_marks(triton=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_layer_computes_what_transformers_layer_computes(arch):
    from helpers.gpu_layer_checks import check_hf

    r = check_hf(arch, "float32", GPU)
    assert all(r[k] < 1e-4 for k in ("prefill", "tree", "keys", "values")), r
    r = check_hf(arch, "bfloat16", GPU)
    for name in ("prefill", "tree"):  # no further from transformers in float32 than its own bfloat16 layer
        assert r[name + "_ours"] <= 1.25 * r[name + "_theirs"] + 1e-3, r
    assert r["keys"] < 2e-2 and r["values"] < 2e-2, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_n", [16, 64])
def test_a_tree_node_equals_the_token_decoded_alone_bit_for_bit(dtype, block_n):
    from helpers.gpu_layer_checks import check_invariance

    from offspec.formats.gpu import attention

    default = attention.BLOCK_N
    try:
        r = check_invariance(dtype, GPU, block_n=block_n)
    finally:
        attention.BLOCK_N = default
    assert r["finite"] and r["chunked_prefill"], r
    assert all(r["alone"]) and all(r["cache"]), r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_graph_replay_equals_the_eager_call(dtype):
    from helpers.gpu_layer_checks import check_graphs

    from offspec.formats.gpu.graphs import CudaCapturer

    r = check_graphs(dtype, GPU, capturer=CudaCapturer(GPU))
    torch.cuda.synchronize(GPU)
    assert all(r["rows"]) and all(r["cache"]) and (r["captures"], r["replays"]) == (2, 3), r


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    from helpers.tiny_gguf import save_tiny_gguf

    root = tmp_path_factory.mktemp("cuda-gguf-pair")
    target = save_tiny_gguf(root / "target.gguf", "qwen2", seed=0, layers=4)
    draft = save_tiny_gguf(root / "draft.gguf", "qwen2", seed=0, layers=4, noise=0.002)
    return str(target), str(draft)


@pytest.mark.parametrize("streamed", [False, True])
def test_greedy_speculation_equals_the_target_alone_in_bfloat16(gguf_pair, tmp_path, monkeypatch, streamed):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OFFSPEC_CUDA_KERNELS", raising=False)
    monkeypatch.delenv("OFFSPEC_LAYERS", raising=False)
    options = dict(device=str(GPU), max_context=1024, max_budget=1024, offload_dir=str(tmp_path / "offload"))
    if streamed:  # the smallest device budget that holds the draft, caches and the ring: layers stream
        with pytest.raises(OffspecError) as info:
            offspec.load(*gguf_pair, device_mem="1KB", **options)
        options.update(device_mem=re.search(r"--device-mem (\S+)", str(info.value))[1], ram_mem="1MB")
    gen = offspec.load(*gguf_pair, **options)
    try:
        assert gen.info.dtype == "bfloat16"  # the CUDA default on compute capability 8.0 and newer
        target = gen.engine.target
        assert target.gpu_layers is not None, target.gpu_layers_unsupported
        assert gen.engine.drafter.runner.gpu_layers is not None, gen.engine.drafter.runner.gpu_layers_unsupported
        assert target.head_is_row_invariant  # the walk's LM head rows go in one batch-invariant call
        if streamed:
            assert target.io is not None and gen.info.extra["placement"]["layers"]["device"] < 4
        messages = []
        for turn in ("Hello there", "Tell me more about it", "And then?"):
            messages.append({"role": "user", "content": turn})
            plain = gen.generate(messages, max_new_tokens=24, speculate=False)
            assert len(plain.token_ids) > 0
            for budget in (1, 4, 32, 256, 1024):
                result = gen.generate(messages, max_new_tokens=24, budget=budget)
                assert result.token_ids == plain.token_ids, (turn, budget)
            messages.append({"role": "assistant", "content": gen.decode(plain.token_ids)})
    finally:
        gen.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_models_body_runs_the_installed_layers_as_the_runner_calls_it(arch):
    from helpers.gpu_layer_checks import check_model

    r = check_model(arch, GPU)
    assert r["installed"] and all(r[k] < 1e-4 for k in ("prefill", "tree", "keys")), r
