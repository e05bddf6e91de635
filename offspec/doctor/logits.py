"""Do streamed layers compute exactly what resident ones do? A small random Llama is loaded twice through the
same offloading loader and packed files: once with every layer resident, once with its layers on the device,
in (pinned) RAM and on SSD through the layer streamer. The logits of a causal prefill and of a tree pass
(siblings sharing positions) must be equal, bit for bit: the only difference is where the weights came from.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from offspec.formats.cpu_linear import speed_up_cpu_linears
from offspec.models.sources import ResolvedModel
from offspec.offload.config import OffloadConfig
from offspec.offload.model import load_offloaded
from offspec.spec.runner import ModelRunner
from offspec.util.hf import quiet_transformers

TIERS = ("device", "ram", "ssd", "ssd")


def save_random_llama(path: Path, seed: int = 0) -> Path:
    """A 4-layer random Llama (hidden 128, vocab 512) saved as safetensors, without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM


    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(TIERS),
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    with quiet_transformers():
        model.save_pretrained(path, safe_serialization=True)
    return path


def passes(model) -> list[torch.Tensor]:
    """Logits of a 9-token causal prefill, then of a 5-node tree over it (siblings share positions), in the
    model's dtype, on the host (also what tests/test_offload_forward.py compares)."""
    runner = ModelRunner(model, capacity=64)
    device = runner.device
    ids = torch.tensor([5, 9, 33, 70, 71, 72, 100, 3, 44], device=device)  # (9,)
    q = len(ids)
    pos = torch.arange(q, device=device)  # (q,)
    causal = torch.ones(q, q, dtype=torch.bool, device=device).tril()  # (q, q)
    out = [runner.logits(runner.forward(ids, pos, pos, causal)).cpu()]
    runner.cache.length = q
    tree = torch.tensor([50, 60, 61, 62, 70], device=device)  # (5,) root, two children of it, a grandchild, ...
    parents = [-1, 0, 0, 1, 3]
    depth = torch.tensor([0, 1, 1, 2, 3], device=device)  # (5,)
    visible = torch.zeros(5, q + 5, dtype=torch.bool, device=device)  # (5, q + 5): prefix, self, ancestors
    visible[:, :q] = True
    for i in range(5):
        j = i
        while j >= 0:
            visible[i, q + j] = True
            j = parents[j]
    slots = torch.arange(q, q + 5, device=device)  # (5,)
    out.append(runner.logits(runner.forward(tree, q + depth, slots, visible)).cpu())
    return out


def compare(device: torch.device, dtype: torch.dtype, workdir: Path) -> dict:
    """Resident vs streamed logits of the random Llama on `device` in `dtype`: equal, and the largest difference."""
    resolved = ResolvedModel(name="random-llama", path=save_random_llama(workdir / "random-llama"), kind="local")
    config = OffloadConfig(offload_dir=workdir / "packed", pack_always=True, max_context=64, max_budget=16)
    models, handles = [], []
    for tiers in (("device",) * len(TIERS), TIERS):
        model, handle = load_offloaded(resolved, device=device, dtype=dtype, attn_implementation="sdpa",
                                       config=config, tiers=tiers, report=False)
        if device.type == "cpu":
            speed_up_cpu_linears(model)  # as offspec.load does on a CPU
        models.append(model)
        handles.append(handle)
    try:
        want, got = passes(models[0]), passes(models[1])
        streamed_bytes = handles[1].streamer.counters()[0]
    finally:
        handles[1].streamer.close()
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, want)), "max_difference": diff,
            "tiers": list(TIERS), "bytes_streamed": streamed_bytes, "dtype": str(dtype).removeprefix("torch.")}


def compare_in_temp(device: torch.device, dtype: torch.dtype) -> dict:
    with tempfile.TemporaryDirectory(prefix="offspec-doctor-") as workdir:
        return compare(device, dtype, Path(workdir))
