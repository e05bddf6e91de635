"""A GGUF stays in its own ggml blocks: conversion into the weight store, exact weights, loading (resident and
streamed), losslessness of speculation, damage detection, interrupted conversions and early refusals.

Tier 2: tiny random GGUFs written by tests/helpers/tiny_gguf.py (Q4_K/Q6_K like a Q4_K_M file, plus other types: the
legacy ones, IQ4_XS / IQ4_NL, MXFP4 (gpt-oss's experts), and the lattice (IQ1-IQ3) and ternary (TQ) types as random
valid blocks)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers.tiny_gguf import mapped_file, save_shape_twin, save_tiny_gguf

import offspec
from offspec import OffspecError
from offspec.formats import kernels
from offspec.formats.dequant import dequantize as torch_dequantize
from offspec.formats.ggml import INTEGER_NAMES, KERNEL_TYPES, activation_block
from offspec.formats.modules import QEmbedding, QLinear
from offspec.models.convert import ensure_converted
from offspec.store.entry import MANIFEST, converted_dir, gguf_key, verify_entry

LOAD = dict(max_context=256, max_budget=64)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict:
    """Tiny GGUF targets and drafts (drafts: the target's weights plus noise), per architecture, and variants."""
    root = tmp_path_factory.mktemp("ggufs")
    out = {}
    for arch in ("qwen2", "llama"):
        out[arch] = save_tiny_gguf(root / f"{arch}-target.gguf", arch, seed=0, layers=8)
        out[arch + "-draft"] = save_tiny_gguf(root / f"{arch}-draft.gguf", arch, seed=0, layers=8, noise=0.002)
    out["other-seed"] = save_tiny_gguf(root / "other-seed.gguf", "qwen2", seed=7, layers=4)
    out["tied"] = save_tiny_gguf(root / "tied.gguf", "llama", seed=2, tied=True)
    out["legacy"] = save_tiny_gguf(root / "legacy.gguf", "qwen2", seed=3, types={
        "linear": "Q5_0", "down": "Q4_1", "v": "Q8_0", "embed": "Q5_1", "output": "Q4_0"})
    for name, noise in (("iq4", 0.0), ("iq4-draft", 0.002)):  # like an IQ4_XS file (IQ4_NL where rows are short)
        out[name] = save_tiny_gguf(root / f"{name}.gguf", "llama", seed=5, layers=8, noise=noise, types=IQ4)
    out["lattice"] = save_tiny_gguf(root / "lattice.gguf", "qwen2", seed=6, types={
        "linear": "IQ2_XXS", "down": "IQ2_XS", "v": "IQ2_S", "embed": "TQ1_0", "output": "IQ3_XXS"})
    out["lattice2"] = save_tiny_gguf(root / "lattice2.gguf", "llama", seed=7, types={
        "linear": "IQ3_S", "down": "IQ1_S", "v": "IQ1_M", "embed": "TQ2_0", "output": "IQ4_NL"})
    out["mxfp4"] = save_tiny_gguf(root / "mxfp4.gguf", "llama", seed=8, types=MXFP4)
    return out


IQ4 = {"linear": "IQ4_XS", "down": "IQ4_XS", "v": "IQ4_NL", "embed": "IQ4_XS", "output": "IQ4_NL"}
MXFP4 = {"linear": "MXFP4", "down": "MXFP4", "v": "MXFP4", "embed": "MXFP4", "output": "Q8_0"}  # and a Q8_0 head


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return root


def _entry(gguf: Path) -> Path:
    return converted_dir(gguf_key(gguf))


def _float_reference(gguf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)


def _lowbit(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QLinear, QEmbedding))}


# --- conversion ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,types", [("qwen2", {"Q4_K", "Q6_K"}), ("iq4", {"IQ4_XS", "IQ4_NL"}),
                                        ("lattice", {"IQ2_XXS", "IQ2_XS", "IQ2_S", "TQ1_0", "IQ3_XXS"}),
                                        ("lattice2", {"IQ3_S", "IQ1_S", "IQ1_M", "TQ2_0", "IQ4_NL"}),
                                        ("mxfp4", {"MXFP4", "Q8_0"})])
def test_conversion_keeps_the_gguf_blocks_at_the_gguf_size(cache, ggufs, name, types):
    import gguf as gguf_py

    events = []
    entry = ensure_converted(ggufs[name], key=gguf_key(ggufs[name]), source="test", progress=events.append)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["weights"] == "ggml" and set(manifest["types"]) == types and manifest["notes"] == []
    assert any("kept as they are" in e.message for e in events)
    reader = gguf_py.GGUFReader(str(ggufs[name]))
    quantized = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name != "F32")
    assert sum(manifest["types"].values()) == quantized  # every block stored once, as it is
    store = sum(f.stat().st_size for f in (entry / "weights").iterdir())
    files = len(list((entry / "weights").glob("*.bin")))
    assert store <= ggufs[name].stat().st_size + files * 3 * 4096  # the GGUF's bytes plus headers and padding
    assert verify_entry(entry) is None and verify_entry(entry, deep=True) is None


@pytest.mark.slow
def test_a_70b_shape_twin_in_iq4_xs_costs_no_more_on_disk_than_its_gguf(cache, tmp_path):
    """Llama-3-70B's shapes (hidden 8192, FFN 28672, 64 heads, 8 KV heads) in IQ4_XS, 2 of its 80 layers (0.9 GB of
    random valid blocks): each layer file holds the GGUF's blocks as they are, plus at most 12 KiB of header and
    alignment, so the whole 70B entry costs what its file does (7.5x that before, in float32, when IQ4_XS had no
    kernel); and the twin runs."""
    import gguf as gguf_py

    src = save_shape_twin(tmp_path / "twin.gguf", layers=2)
    entry = ensure_converted(src, key=gguf_key(src), source="test")
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["weights"] == "ggml" and set(manifest["types"]) == {"IQ4_XS", "Q6_K"}
    reader = gguf_py.GGUFReader(str(src))
    for i in range(2):
        layer = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{i}."))
        assert layer > 400 * 2**20  # the 70B's layer: 855M weights at 4.25 bits
        assert (entry / "weights" / f"layer-{i:04d}.bin").stat().st_size <= layer + 3 * 4096
    stored = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())  # weights, config, tokenizer, manifest
    assert stored <= src.stat().st_size + 2**20
    gen = offspec.load(str(src), str(src), budget=4, **LOAD)
    assert len(gen.generate("Hi", max_new_tokens=2, speculate=False).token_ids) == 2


@pytest.mark.parametrize("name", ["qwen2", pytest.param("llama", marks=pytest.mark.slow), "tied", pytest.param("legacy", marks=pytest.mark.slow), "iq4",
                                  pytest.param("lattice", marks=pytest.mark.slow), pytest.param("lattice2", marks=pytest.mark.slow),
                                  "mxfp4"])
def test_stored_weights_are_bitwise_what_transformers_reads(cache, ggufs, name):
    gen = offspec.load(str(ggufs[name]), str(ggufs[name]), budget=4, **LOAD)
    model = gen.engine.target.model
    reference = _float_reference(ggufs[name]).state_dict()
    lowbit = _lowbit(model)
    assert len(lowbit) >= 7  # every linear layer, the token table and the LM head
    for module_name, module in lowbit.items():
        cols = module.in_features if isinstance(module, QLinear) else module.embedding_dim
        rows = kernels.stored_rows(module) if isinstance(module, QLinear) else module.qweight
        weight = kernels.dequantize_rows(rows.cpu(), module.type_id, cols)
        assert torch.equal(weight, reference[module_name + ".weight"]), module_name  # llama: q/k rows reordered
    if name == "tied":
        assert model.get_output_embeddings().qweight is model.get_input_embeddings().qweight
    assert gen.info.extra["placement"]["weight_formats"]


def _reference_linear(x, qweight, type_id, cols, bias=None):
    """The kernels' arithmetic in float64: exact weights; for the types with integer kernels, activations rounded to
    8 bits per block of 256 (K-quants, IQ4_XS: ggml's Q8_K), else per block of 32 (Q8_0). Rows interleaved for the
    CPU kernels (a resident layer's, `type_id` past X16_TYPES) are read back in their stored order."""
    if type_id >= kernels.X16_TYPES:
        type_id -= kernels.X16_TYPES
        qweight = kernels.compiled().interleave(qweight.contiguous(), type_id, cols, False)
    w = torch_dequantize(qweight, type_id, cols).double()
    xd = x.double().reshape(-1, cols)
    type_name = KERNEL_TYPES[type_id].name
    if type_name in INTEGER_NAMES:
        blocks = xd.float().reshape(xd.shape[0], -1, activation_block(type_name))
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d != 0, 1 / torch.where(d == 0, torch.ones_like(d), d), torch.zeros_like(d))
        xd = (torch.round(blocks * inv) * d).double().reshape(xd.shape)
    y = xd @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


@pytest.mark.parametrize("name", [pytest.param("qwen2", marks=pytest.mark.slow), "llama", pytest.param("legacy", marks=pytest.mark.slow), "iq4", pytest.param("lattice", marks=pytest.mark.slow),
                                  pytest.param("lattice2", marks=pytest.mark.slow), "mxfp4"])
def test_every_low_bit_layer_computes_the_reference_arithmetic_on_its_inputs(cache, ggufs, name):
    """Inside the real forward pass, each QLinear's output equals a float64 reference of the kernels' arithmetic
    applied to the input it actually got (layer by layer: no amplification through depth)."""
    gen = offspec.load(str(ggufs[name]), str(ggufs[name]), budget=4, **LOAD)
    model = gen.engine.target.model
    checked = []

    def check(module, args, output):
        want = _reference_linear(args[0], kernels.stored_rows(module), module.type_id, module.in_features, module.bias)
        torch.testing.assert_close(output, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        checked.append(module)

    hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, QLinear)]
    with torch.no_grad():
        model(torch.tensor([[5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7]]))
    for h in hooks:
        h.remove()
    assert len(checked) == sum(isinstance(m, QLinear) for m in model.modules())


def test_a_shallow_model_computes_the_reference_end_to_end(cache, ggufs, monkeypatch):
    gen = offspec.load(str(ggufs["legacy"]), str(ggufs["legacy"]), budget=4, **LOAD)  # 2 layers
    model = gen.engine.target.model
    ids = torch.tensor([[5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7]])
    with torch.no_grad():
        got = model(ids).logits
        monkeypatch.setattr(kernels, "linear", _reference_linear)
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.slow
def test_resident_weights_on_a_cpu_are_the_store_files_own_pages(cache, ggufs):
    """Resident layers (the whole draft, a resident target) and the `other` payload (LM head, final norm) are
    memory-mapped from the store's files, not copied into anonymous memory: under a memory cap the kernel can
    drop and re-read them instead of killing the process. They compute the same as before (the tests above)."""
    gen = offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2-draft"]), **LOAD)
    for model in (gen.engine.target.model, gen.engine.drafter.runner.model):
        layer = _lowbit(model)["model.layers.0.mlp.down_proj"]
        assert re.search(r"/weights/layer-0000\.bin$", mapped_file(layer.qweight)), mapped_file(layer.qweight)
    head = gen.engine.target.model.get_output_embeddings()
    assert mapped_file(head.qweight).endswith("/weights/other.bin")
    assert gen.generate("Hello", max_new_tokens=4, budget=4).token_ids  # and they run


# --- losslessness --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=pytest.mark.slow), "llama", pytest.param("iq4", marks=pytest.mark.slow)])
def test_speculative_greedy_equals_the_target_alone_resident_and_streamed(cache, ggufs, arch, tmp_path):
    target, draft = str(ggufs[arch]), str(ggufs[arch + "-draft"])
    resident = offspec.load(target, draft, **LOAD)
    plain = resident.generate("Hello there", max_new_tokens=48, speculate=False)
    with pytest.raises(OffspecError) as info:  # the smallest budget offspec accepts streams every layer
        offspec.load(target, draft, device_mem="1KB", offload_dir=str(tmp_path), **LOAD)
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    streamed = offspec.load(target, draft, device_mem=budget, offload_dir=str(tmp_path), **LOAD)
    placement = streamed.info.extra["placement"]
    assert placement["layers"]["ssd"] >= 1 and placement["quant"] == "ggml"
    assert streamed.generate("Hello there", max_new_tokens=48, speculate=False).token_ids == plain.token_ids
    if arch != "iq4":  # Q4_K/Q6_K weights: the resident layers' rows interleaved for the kernels, streamed ones not
        resident_layers = [m for n, m in _lowbit(resident.engine.target.model).items() if ".layers." in n]
        streamed_layers = [m for n, m in _lowbit(streamed.engine.target.model).items() if ".layers." in n]
        wanted = kernels.interleaves()  # AVX2 or better (a scalar build keeps rows)
        assert all(m.interleaved == wanted for m in resident_layers
                   if KERNEL_TYPES[m.type_id].name in kernels.X16_NAMES and m.out_features >= 16)
        assert any(m.interleaved for m in resident_layers) == wanted
        assert not any(m.interleaved for m in streamed_layers)
        assert resident.engine.target.model.get_output_embeddings().interleaved == wanted  # a head of its own
    accepted = 0
    for gen in (resident, streamed):
        for nodes in (1, 8, 64):
            result = gen.generate("Hello there", max_new_tokens=48, budget=nodes)
            assert result.token_ids == plain.token_ids, (gen is streamed, nodes)
            accepted += sum(p.accepted for p in result.passes)
    assert accepted > 0  # the draft was right often enough to exercise acceptance
    streamed.engine.target.io.close()


@pytest.mark.slow
def test_multi_turn_on_a_gguf_pair_reuses_the_cache_and_matches_a_fresh_run(cache, ggufs):
    gen = offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2-draft"]), **LOAD)
    first = gen.generate([{"role": "user", "content": "Hi"}], max_new_tokens=12, budget=8)
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": "More"}]
    again = gen.generate(turn, max_new_tokens=12, budget=8)
    fresh = offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2-draft"]), **LOAD)
    assert fresh.generate(turn, max_new_tokens=12, speculate=False).token_ids == again.token_ids


# --- damage, old entries, interrupts -------------------------------------------------------------


def _output(gguf: Path) -> list[int]:
    return offspec.load(str(gguf), str(gguf), budget=4, **LOAD).generate("abc", max_new_tokens=12).token_ids


@pytest.mark.parametrize("victim", [pytest.param("weights/layer-0001.bin", marks=pytest.mark.slow),
                                    pytest.param("weights/other.bin", marks=pytest.mark.slow),
                                    pytest.param("weights/embed.bin", marks=pytest.mark.slow), "config.json"])
def test_damaged_content_of_the_right_size_is_found_and_rebuilt(cache, ggufs, victim):
    want = _output(ggufs["qwen2"])
    path = _entry(ggufs["qwen2"]) / victim
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = os.urandom(64)  # same size, new content
    path.write_bytes(bytes(data))
    assert "damaged" in verify_entry(_entry(ggufs["qwen2"]))
    events = []
    gen = offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2"]), budget=4, progress=events.append, **LOAD)
    assert any("unusable" in e.message and "rebuilding" in e.message for e in events)
    assert gen.generate("abc", max_new_tokens=12).token_ids == want


@pytest.mark.slow
def test_damage_that_keeps_the_mtime_is_caught_by_the_layer_checksums(cache, ggufs):
    want = _output(ggufs["qwen2"])
    path = _entry(ggufs["qwen2"]) / "weights" / "layer-0002.bin"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the manifest's size and mtime still match
    events = []
    gen = offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2"]), budget=4, progress=events.append, **LOAD)
    assert any("damaged" in e.message and "rebuilding now" in e.message for e in events)
    assert gen.generate("abc", max_new_tokens=12).token_ids == want


def test_an_old_float32_entry_is_removed(cache, ggufs):
    old = _entry(ggufs["qwen2"]).with_name(_entry(ggufs["qwen2"]).name + "-float32")
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"\0" * 1000)
    events = []
    ensure_converted(ggufs["qwen2"], key=gguf_key(ggufs["qwen2"]), source="test", progress=events.append)
    assert not old.exists() and any("old float cache entry" in e.message for e in events)


def test_an_interrupted_conversion_leaves_no_temp_and_dead_temps_are_removed(cache, ggufs, monkeypatch):
    from offspec.store import packed

    real = packed.write_layer
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(packed, "write_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_converted(ggufs["qwen2"], key=gguf_key(ggufs["qwen2"]), source="test")
    models = cache / "models"
    assert [p.name for p in models.iterdir()] == []  # nothing half-written is left
    monkeypatch.setattr(packed, "write_layer", real)
    dead = models / f".x.tmp-{2**22 + 12345}-abcd"  # a pid that does not exist (above the default pid_max)
    alive = models / f".y.tmp-{os.getppid()}-abcd"  # a live process's temp: not ours to remove
    for d in (dead, alive):
        d.mkdir()
        (d / "layer-0000.bin").write_bytes(b"x" * 100)
    ensure_converted(ggufs["qwen2"], key=gguf_key(ggufs["qwen2"]), source="test")
    assert not dead.exists() and alive.exists()


# --- early refusals ------------------------------------------------------------------------------


def test_a_truncated_gguf_is_one_line_that_says_so(cache, ggufs, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = ggufs["qwen2"].read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(OffspecError) as info:
        offspec.load(str(cut), str(cut), **LOAD)
    message = str(info.value)
    assert "\n" not in message and "truncated or damaged" in message and "download it again" in message


def test_a_gguf_draft_with_another_tokenizer_proposes_through_text(cache, ggufs, tmp_path):
    """Not refused: the draft keeps its own tokenizer, its proposals are mapped (offspec/spec/xvocab.py), and the
    output is the target's."""
    other = save_tiny_gguf(tmp_path / "wide.gguf", "qwen2", seed=1, vocab_extra=16)
    gen = offspec.load(str(ggufs["qwen2"]), str(other), **LOAD)
    assert "draft_mapping" in gen.info.extra
    plain = gen.generate("Hello", max_new_tokens=16, speculate=False)
    assert gen.generate("Hello", max_new_tokens=16, budget=16, drafter="model").token_ids == plain.token_ids


def test_quant_flags_on_a_gguf_and_nf4_on_a_cpu_are_refused_before_loading(cache, ggufs, tiny_dirs):
    with pytest.raises(OffspecError, match="keeps its own quantization"):
        offspec.load(str(ggufs["qwen2"]), str(ggufs["qwen2"]), quant="int8", **LOAD)
    target, draft = tiny_dirs[("qwen2", 0)]
    with pytest.raises(OffspecError, match="nf4 needs a CUDA GPU"):
        offspec.load(str(target), str(draft), quant="nf4", **LOAD)
    assert not (cache / "models").exists()


def test_a_tensor_type_no_code_path_reads_is_one_line_and_writes_nothing(cache, tmp_path):
    src = save_tiny_gguf(tmp_path / "nvfp4.gguf", "qwen2", seed=4, types={"v": "NVFP4"})
    with pytest.raises(OffspecError) as info:
        offspec.load(str(src), str(src), **LOAD)
    message = str(info.value)
    assert "\n" not in message and "blk.0.attn_v.weight is NVFP4" in message and "another quantization" in message
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())  # nothing was written
