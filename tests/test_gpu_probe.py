"""A card that cannot compile or launch one of offspec's kernel configurations, on a CPU: the launch (launch._run,
where Triton compiles a kernel, checks it against the card and runs it) replaced by one that raises Triton's own
OutOfResources for the configuration the H100 refused (64-row tiles: its _gemm then), the rest recorded.

- the probe launches every configuration a model's passes can: each weight type's three tilings, the biased q/k/v
  group, the split sums, the layer kernels of its geometry, the token table's decode;
- a refusal is caught there, once, before the engine is built: one line names the configuration and Triton's
  reason, this process falls back to torch's decode + cuBLAS (OFFSPEC_CUDA_KERNELS=triton: a one-line error),
  offspec's CUDA layers are not installed and say why, the loader shows the line, the doctor fails with it.
"""

import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny import tiny_config

from offspec import OffspecError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")
CPU, BF16 = torch.device("cpu"), torch.bfloat16
TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
         "up_proj": "Q8_0", "down_proj": "Q6_K"}


@pytest.fixture
def model():
    """A tiny qwen2 (q/k/v biases) whose linears, LM head and token table are ggml blocks (contents never read)."""
    from transformers import Qwen2ForCausalLM

    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu.support import PROJECTIONS
    from offspec.formats.modules import replace_embedding, replace_linear

    config = tiny_config("qwen2", hidden=256, heads=4, kv_heads=2, layers=2)
    m = Qwen2ForCausalLM(config).eval()
    for layer in m.model.layers:
        for name in PROJECTIONS:
            replace_linear(layer, name, ggml_type(TYPES[name.rsplit(".", 1)[1]]).id, CPU)
    replace_linear(m, "lm_head", ggml_type("Q6_K").id, CPU)
    replace_embedding(m, "model.embed_tokens", ggml_type("Q8_0").id, BF16, CPU)
    return m


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    from offspec.formats.gpu import choice

    monkeypatch.setattr(choice, "_fallback", None)
    monkeypatch.delenv(choice.VARIABLE, raising=False)
    monkeypatch.delenv("OFFSPEC_LAYERS", raising=False)


def _card(monkeypatch, refuses=lambda launch: False) -> list:
    """Launches go to a card that refuses those `refuses` picks (Triton's OutOfResources), the rest recorded."""
    from triton.runtime.errors import OutOfResources

    from offspec.formats.gpu import launch

    seen = []

    def run(one):
        seen.append(one)
        if refuses(one):
            raise OutOfResources(262144, 232448, "shared memory")

    monkeypatch.setattr(launch, "_run", run)
    return seen


def _h100(launch):  # the configuration the H100 could not launch: 64-row tiles (the old scratch GEMM's place)
    return launch.kernel.fn.__name__ == "_fused" and launch.kwargs["BM"] == 64 and not launch.kwargs["GRID_SPLIT"]


def test_the_probe_launches_every_configuration_a_models_passes_can(model, monkeypatch):
    from offspec.formats.gpu import choice, probe

    seen = _card(monkeypatch)
    assert probe.check_models(CPU, BF16, [model]) is None and choice.fallback() is None
    fused = {(lc.kwargs["TYPE"], lc.kwargs["BM"], lc.kwargs["GRID_SPLIT"], lc.kwargs["HAS_BIAS"]) for lc in seen
             if lc.kernel.fn.__name__ == "_fused"}
    # the three tilings where a width splits K (Q6_K's down and Q8_0's up: 512 and 256 columns, 2 and 8 units);
    # one unit of 256 (Q4_K's 256 columns) never splits, at any row count: its two tilings
    for name in ("Q6_K", "Q8_0"):
        assert {(name, 16, True, False), (name, 64, True, False), (name, 64, False, False)} <= fused, name
    assert {("Q4_K", 16, False, False), ("Q4_K", 64, False, False)} <= fused
    assert {("Q4_K", 16, False, True), ("Q6_K", 64, False, True)} <= fused  # the q/k/v group's bias
    names = {lc.kernel.fn.__name__ for lc in seen}
    assert names == {"_fused", "_reduce", "_decode", "_add_rms_norm", "_rope_kv", "_prefix", "_tail"}
    assert all(lc.kwargs["enable_fp_fusion"] is False for lc in seen)


def test_a_card_that_refuses_a_configuration_makes_offspec_fall_back_in_one_line(model, monkeypatch):
    from offspec.formats.gpu import choice, probe, support

    _card(monkeypatch, _h100)
    line = probe.check_models(CPU, BF16, [model])
    assert line is not None and "\n" not in line
    assert re.search(r"the Q\w+ linear of \d+ columns at (17|65) rows \(bfloat16", line)  # a 64-row tiling
    assert "OutOfResources: out of resource: shared memory, Required: 262144" in line
    assert line.endswith("using torch's decode + cuBLAS instead")
    assert choice.cuda_kernels() == "torch" and choice.fallback() in line
    reason = support.cuda_layers(model, torch.device("cuda"), BF16)
    assert reason.startswith("offspec's CUDA layers need the Triton kernels, which cannot run on this GPU (")


def test_offspec_cuda_kernels_triton_makes_the_refusal_an_error(model, monkeypatch):
    from offspec.formats.gpu import choice, probe

    _card(monkeypatch, _h100)
    monkeypatch.setenv(choice.VARIABLE, "triton")
    with pytest.raises(OffspecError) as info:
        probe.check_models(CPU, BF16, [model])
    assert "\n" not in str(info.value) and "OFFSPEC_CUDA_KERNELS=triton, but" in str(info.value)
    assert choice.fallback() is None and choice.cuda_kernels() == "triton"


def test_the_loader_checks_before_building_the_engine_and_says_it_once(model, monkeypatch):
    """api.load's step on CUDA (the probe's tensors on the CPU here: this machine has no CUDA)."""
    from offspec import api
    from offspec.formats.gpu import choice, probe

    real = probe.probe
    monkeypatch.setattr(probe, "probe", lambda device, *a, **k: real(CPU, *a, **k))
    _card(monkeypatch, _h100)
    events = []
    plan = SimpleNamespace(device=torch.device("cuda"), dtype=BF16)
    loaded = SimpleNamespace(target=SimpleNamespace(model=model), draft=None)
    line = api._cuda_kernels_fit(plan, loaded, events.append)
    assert [(e.step, e.message) for e in events] == [("kernels", line)] and choice.fallback() in line
    assert api._cuda_kernels_fit(plan, loaded, events.append) is None and len(events) == 1  # once a process


def test_the_doctor_says_it_too(monkeypatch):
    from offspec.doctor import kernels
    from offspec.formats.gpu import launch, probe

    real = probe.probe
    monkeypatch.setattr(probe, "probe", lambda device, *a, **k: real(CPU, *a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "card", lambda device: launch.Card("a test card", 89, 128, 101376))
    _card(monkeypatch)
    check = kernels.kernels_check(torch.device("cuda"), BF16, quick=True)
    assert check.status == "pass" and "Q4_K, Q6_K" in check.reason, check
    _card(monkeypatch, _h100)
    check = kernels.kernels_check(torch.device("cuda"), BF16, quick=True)
    assert check.status == "fail" and "\n" not in check.line(), check
    assert "OutOfResources" in check.reason and check.reason.endswith("torch's decode + cuBLAS here (slower)")
