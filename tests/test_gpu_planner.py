"""The planner on a GPU, with fake hardware numbers: the FLOP term of a pass, the largest tree a card computes
usefully, and activations without materialized attention scores where offspec's CUDA layers run."""

import math
from types import SimpleNamespace

import pytest
import torch

from offspec.offload import estimates
from offspec.offload.estimates import activation_bytes, compute_budget, draft_headroom, matmul_params, target_headroom
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.planner import PairCosts, PlannerConfig, plan
from offspec.profile.projection import Assumptions, project
from offspec.profile.store import costs_of

LLAMA_70B = SimpleNamespace(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                            num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192)
QWEN_1_5B = SimpleNamespace(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                            num_key_value_heads=2, head_dim=128, vocab_size=151936, max_position_embeddings=32768)
GB = 10**9


def test_matmul_params_count_the_layers_products():
    assert matmul_params(LLAMA_70B) == 80 * (8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672)
    assert 68e9 < matmul_params(LLAMA_70B) < 70e9  # 70B less its embeddings and head
    assert 1.2e9 < matmul_params(QWEN_1_5B) < 1.4e9


def test_the_largest_tree_is_what_the_card_computes_within_twice_the_pass_floor():
    # 70B at 80 TFLOP/s usable: 1.75 ms per token; a 0.8 s streamed pass allows 2 x 0.8 s: 914 tokens -> 512
    assert compute_budget(70e9, 80e12, 0.8) == 512
    assert compute_budget(70e9, 80e12, 0.8, headroom=4.0) == 1024
    assert compute_budget(70e9, 80e12, 0.8, ceiling=256) == 256
    assert compute_budget(70e9, 80e12, 1e-3) == estimates.MIN_COMPUTE_BUDGET  # resident and fast: the floor
    assert compute_budget(1.5e9, 400e12, 1.0) == 4096  # a small model on a big card: the ceiling
    for floor in (0.01, 0.1, 0.5, 2.0):  # monotone in the floor, and within the headroom at that budget
        b = compute_budget(70e9, 80e12, floor)
        assert b == estimates.MIN_COMPUTE_BUDGET or 2 * 70e9 * (b + 1) / 80e12 <= 2 * floor


def test_no_reserve_for_materialized_scores_where_attention_keeps_none():
    tokens, kv = 4097, 8192
    with_scores = activation_bytes(LLAMA_70B, tokens, kv, 2)
    without = activation_bytes(LLAMA_70B, tokens, kv, 2, materialized_scores=False)
    scores = 64 * tokens * kv * 2
    assert with_scores - without > scores * 0.95  # 4.3 GB of scores (plus the additive mask) not reserved
    assert without < 2 * GB
    kv_only, act = target_headroom(LLAMA_70B, 4096, 4096, 2, materialized_scores=False)
    kv_with, act_with = target_headroom(LLAMA_70B, 4096, 4096, 2)
    assert kv_only == kv_with and act < act_with / 3
    assert draft_headroom(QWEN_1_5B, 4096, 1024, 2, materialized_scores=False) < draft_headroom(QWEN_1_5B, 4096,
                                                                                                 1024, 2)


def _costs(flop_seconds: float) -> PairCosts:
    flat = CostCurve.of([(1, 0.8), (64, 0.8), (256, 0.81)])  # streamed, link-bound where measured
    step = CostCurve.of([(1, 0.004), (64, 0.005)])
    return PairCosts(target_pass=flat, target_head=0.003, draft_step=step, target_flop_seconds=flop_seconds,
                     draft_flop_seconds=flop_seconds / 100)


def test_the_flop_term_bounds_the_extrapolation_and_leaves_measurements_alone():
    costs = _costs(1.75e-3)
    assert costs.target_pass_seconds(256) == pytest.approx(0.81)  # measured: as measured
    assert costs.target_pass_seconds(4097) == pytest.approx(4097 * 1.75e-3)  # the flat curve would say 0.82
    assert costs.target_pass_seconds(300) == pytest.approx(max(costs.target_pass(300), 300 * 1.75e-3))
    assert costs.draft_step_seconds(512) == pytest.approx(max(costs.draft_step(512), 512 * 1.75e-5))
    assert _costs(0.1).draft_step_seconds(512) == pytest.approx(512 * 1e-3)  # the term above the slope
    assert costs.scaled(target=2.0).target_flop_seconds == pytest.approx(3.5e-3)
    assert costs.scaled(draft=0.5).draft_flop_seconds == pytest.approx(1.75e-5 / 2)
    acceptance = AcceptanceCurve.of([1, 16, 256, 4096], [0.9, 4.0, 8.0, 14.0])
    free = plan(_costs(0.0), acceptance, PlannerConfig())
    bound = plan(costs, acceptance, PlannerConfig())
    assert free.best.budget >= 2048  # a flat extrapolation makes the largest trees look nearly free
    assert bound.best.budget < 4096 and bound.best.tokens_per_second < free.best.tokens_per_second


def test_a_profile_carries_its_flop_terms_to_the_planner():
    data = {"timings": {"target_pass": [[1, 0.1], [8, 0.11]], "target_head_seconds": 0.001,
                        "draft_step": [[1, 0.002]], "target_flop_seconds": 2e-4, "draft_flop_seconds": 1e-5}}
    costs = costs_of(data)
    assert (costs.target_flop_seconds, costs.draft_flop_seconds) == (2e-4, 1e-5)
    del data["timings"]["target_flop_seconds"], data["timings"]["draft_flop_seconds"]
    assert costs_of(data).target_flop_seconds == 0.0  # older profiles: no FLOP term


HW_4090 = {"device_type": "cuda", "device_memory_bytes": 24 * 2**30, "device_memory_bandwidth": 1.0e12,
           "device_flops": 165e12, "host_ram_bytes": 64 * GB, "disk_read_bytes_per_s": 6e9,
           "h2d_pinned_bytes_per_s": 25e9}


def test_a_projection_on_a_gpu_sizes_the_tree_and_its_reserve_from_what_the_card_computes():
    acceptance = AcceptanceCurve.of([1, 16, 256, 1024], [0.9, 4.0, 8.0, 9.0])
    p = project(HW_4090, 70e9, "q4_k_m", 0.5e9, acceptance, "test")
    budget = p.placement["max_budget"]
    assert budget == compute_budget(70e9, 165e12 * Assumptions().compute_efficiency,
                                    max(p.placement["stream_seconds_per_pass"], 70e9 * 4.85 / 8 / 0.8e12))
    assert 64 <= budget < 4096 and p.plan.best.budget <= budget
    fixed = project(HW_4090, 70e9, "q4_k_m", 0.5e9, acceptance, "test", assume=Assumptions(max_budget=4096))
    assert fixed.placement["max_budget"] == 4096
    assert fixed.placement["device_bytes"] < p.placement["device_bytes"]  # a bigger reserve: fewer layers resident
    slow = project({**HW_4090, "device_flops": 20e12}, 70e9, "q4_k_m", 0.5e9, acceptance, "test")
    assert slow.placement["max_budget"] <= budget  # less compute: no bigger tree
    assert any("largest tree" in line for line in p.assumptions)
    cpu = project({**HW_4090, "device_type": "cpu"}, 7e9, "q4_k_m", 0.5e9, acceptance, "test")
    assert cpu.placement["max_budget"] == 4096  # a CPU keeps the engine's default
    assert math.isfinite(p.plan.best.tokens_per_second) and p.plan.best.tokens_per_second > 0


def test_cuda_layers_say_why_they_do_not_run(monkeypatch):
    from helpers.tiny import tiny_config
    from transformers import LlamaForCausalLM

    from offspec.formats.gpu import support

    model = LlamaForCausalLM(tiny_config("llama"))
    cuda = torch.device("cuda", 0)
    assert "run on CUDA" in support.cuda_layers(model, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(support, "cuda_kernels", lambda: "triton")
    assert "holds Linear weights" in support.cuda_layers(model, cuda, torch.bfloat16)
    assert "float64" in support.cuda_layers(model, cuda, torch.float64)
    monkeypatch.setenv(support.LAYERS_VARIABLE, "transformers")
    assert support.cuda_layers(model, cuda, torch.bfloat16) == "OFFSPEC_LAYERS=transformers"
    monkeypatch.delenv(support.LAYERS_VARIABLE)
    monkeypatch.setattr(support, "cuda_kernels", lambda: "torch")
    assert "need the Triton kernels" in support.cuda_layers(model, cuda, torch.bfloat16)
