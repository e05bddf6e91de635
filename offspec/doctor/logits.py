"""Do streamed layers compute exactly what resident ones do? A small random Llama, once loaded whole and once
with its layers on the device, in (pinned) RAM and on SSD through the real packed files and layer streamer:
the logits of a causal prefill and of a tree pass (siblings sharing positions) must be equal, bit for bit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

TIERS = ("device", "ram", "ssd", "ssd")


def save_random_llama(path: Path, seed: int = 0) -> Path:
    """A 4-layer random Llama (hidden 128, vocab 512) saved as safetensors, without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(TIERS),
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    from ..convert import quiet_transformers

    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    with quiet_transformers():
        model.save_pretrained(path, safe_serialization=True)
    return path


def _fresh_parameters(model) -> None:
    """Parameters copied into fresh allocations, as offspec's own buffers are: CPU weights left in the safetensors
    mmap are only 8-byte aligned, where MKL takes other code paths (results differ in the last bits)."""
    for module in model.modules():
        for name, value in list(module._parameters.items()):
            if value is not None:
                module._parameters[name] = torch.nn.Parameter(value.detach().clone(), requires_grad=False)


def passes(model) -> list[torch.Tensor]:
    """Logits of a 9-token causal prefill, then of a 5-node tree over it."""
    from ..runner import ModelRunner

    runner = ModelRunner(model, capacity=64)
    device = runner.device
    ids = torch.tensor([5, 9, 33, 70, 71, 72, 100, 3, 44], device=device)  # (9,)
    q = len(ids)
    pos = torch.arange(q, device=device)  # (q,)
    causal = torch.ones(q, q, dtype=torch.bool, device=device).tril()  # (q, q)
    out = [runner.logits(runner.forward(ids, pos, pos, causal)).float().cpu()]
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
    out.append(runner.logits(runner.forward(tree, q + depth, slots, visible)).float().cpu())
    return out


def compare(device: torch.device, dtype: torch.dtype, workdir: Path) -> dict:
    """Resident vs streamed logits of the random Llama on `device` in `dtype`: equal, and the largest difference."""
    from ..cpu_linear import speed_up_cpu_linears
    from ..loading import load_model
    from ..offload.config import OffloadConfig
    from ..offload.model import load_offloaded
    from ..sources import ResolvedModel

    resolved = ResolvedModel(name="random-llama", path=save_random_llama(workdir / "random-llama"), kind="local")
    resident = load_model(resolved, device=device, dtype=dtype, tokenizer=False).model  # no tokenizer needed
    config = OffloadConfig(offload_dir=workdir / "packed", pack_always=True, max_context=64, max_budget=16)
    streamed, handle = load_offloaded(resolved, device=device, dtype=dtype, attn_implementation="sdpa",
                                      config=config, tiers=TIERS, report=False)
    if device.type == "cpu":  # as offspec.load does on a CPU
        _fresh_parameters(resident)
        for model in (resident, streamed):
            speed_up_cpu_linears(model)
    try:
        want, got = passes(resident), passes(streamed)
        streamed_bytes = handle.streamer.counters()[0]
    finally:
        handle.streamer.close()
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, want)), "max_difference": diff,
            "tiers": list(TIERS), "bytes_streamed": streamed_bytes, "dtype": str(dtype).removeprefix("torch.")}


def compare_in_temp(device: torch.device, dtype: torch.dtype) -> dict:
    with tempfile.TemporaryDirectory(prefix="offspec-doctor-") as workdir:
        return compare(device, dtype, Path(workdir))
