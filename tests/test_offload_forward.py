"""Offloaded forward passes on tiny random models: the same logits as the in-memory model, whatever the tiers."""

import pytest
import torch

from offspec import OffspecError
from offspec.doctor.logits import passes as _passes  # a causal prefill, then a 5-node tree: both logits
from offspec.formats import kernels
from offspec.formats.cpu_linear import speed_up_cpu_linears
from offspec.models.loading import load_model
from offspec.models.sources import ResolvedModel
from offspec.offload.config import OffloadConfig
from offspec.offload.model import load_offloaded
from offspec.offload.quant import dequantize_weight, quantize_weight

CPU = torch.device("cpu")
TIERS = {
    "all resident": ("device",) * 4,
    "all from RAM": ("ram",) * 4,
    "part on SSD": ("device", "ssd", "ram", "ssd"),
    "all from SSD": ("ssd",) * 4,
}


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory):
    from helpers.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("offload-models")
    return {arch: save_tiny_model(root / arch, arch=arch, seed=3, layers=4) for arch in ("llama", "qwen2")}


def _resolved(path):
    return ResolvedModel(name=path.name, path=path, kind="local")


def _aligned(model):
    """Weights copied into fresh (64-byte-aligned) memory. from_pretrained leaves CPU weights in the safetensors
    mmap at 8-byte alignment, where MKL takes other code paths whose float32 results differ in the last bits."""
    for module in model.modules():
        for name, value in list(module._parameters.items()):
            if value is not None:
                module._parameters[name] = torch.nn.Parameter(value.detach().clone(), requires_grad=False)
    return model


def _reference(path, dtype=torch.float32):
    model = _aligned(load_model(_resolved(path), device=CPU, dtype=dtype).model)
    speed_up_cpu_linears(model)  # what offspec.load does on CPU (the offloaded layers get the same kernels)
    return model


def _offloaded(path, tmp_path, tiers, dtype=torch.float32, progress=None, **cfg):
    config = OffloadConfig(offload_dir=tmp_path / "packed", pack_always=True, max_context=64, max_budget=16, **cfg)
    model, handle = load_offloaded(_resolved(path), device=CPU, dtype=dtype, attn_implementation="sdpa",
                                   config=config, tiers=tiers, progress=progress or (lambda e: None))
    speed_up_cpu_linears(model)  # as offspec.load does (resident linears; streamed ones already have it)
    return model, handle


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(TIERS))
def test_offloaded_logits_equal_the_in_memory_model(four_layer_dirs, tmp_path, arch, case):
    want = _passes(_reference(four_layer_dirs[arch]))
    model, handle = _offloaded(four_layer_dirs[arch], tmp_path, TIERS[case])
    got = _passes(model)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # deterministic: the same bytes through the same kernels
    streamed = [i for i, t in enumerate(TIERS[case]) if t != "device"]
    assert (handle.streamer is None) == (not streamed)
    if streamed:
        assert handle.streamer.layers == streamed
        per_pass = sum(handle.placement.sizes.layer_bytes[i] for i in streamed)
        assert handle.streamer.counters()[0] == 2 * per_pass  # two passes, each streamed layer once per pass


def test_float64_offloaded_equals_in_memory(four_layer_dirs, tmp_path):
    want = _passes(_reference(four_layer_dirs["llama"], torch.float64))
    model, _ = _offloaded(four_layer_dirs["llama"], tmp_path, TIERS["part on SSD"], dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(_passes(model), want))


def _dequantized_reference(path, kind):
    """The in-memory model with every weight offspec stores quantized replaced by what its stored form stands for:
    NF4 the decoder linears (bitsandbytes); int4/int8 the decoder linears (Q4_1/Q8_0), the LM head and the token
    table (Q8_0), decoded by the gguf package's reference decoder."""
    import gguf

    from offspec.formats.quantize import quantize_rows, weight_type

    model = _aligned(load_model(_resolved(path), device=CPU, dtype=torch.float32).model)

    def ggml_reference(w, type_id):
        blocks = quantize_rows(w, type_id).numpy()  # (rows, row_bytes) uint8
        return torch.from_numpy(gguf.dequantize(blocks, gguf.GGMLQuantizationType(type_id))).float()

    for layer in model.get_decoder().layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.data
                if kind == "nf4":
                    q = quantize_weight(kind, w)
                    module.weight.data = dequantize_weight(kind, q, w.shape[0], w.shape[1], torch.float32)
                else:
                    module.weight.data = ggml_reference(w, weight_type(kind, w.shape[1]))
    if kind != "nf4":
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        emb.weight.data = ggml_reference(emb.weight.data, weight_type(kind, emb.embedding_dim, head=True))
        if head.weight is not emb.weight:
            head.weight.data = ggml_reference(head.weight.data, weight_type(kind, head.in_features, head=True))
    return model


@pytest.mark.parametrize("kind,ratio", [pytest.param("nf4", 3, marks=pytest.mark.slow), ("int4", 3), ("int8", 1.8)])
def test_quantized_offloaded_logits_match_the_dequantized_model(four_layer_dirs, tmp_path, kind, ratio):
    path = four_layer_dirs["qwen2"]  # q/k/v biases too
    events = []
    model, handle = _offloaded(path, tmp_path, TIERS["part on SSD"], quant=kind, progress=events.append)
    assert any(e.step == "quantize" and e.finished for e in events)
    got, want = _passes(model), _passes(_dequantized_reference(path, kind))
    # nf4: the same float weights through another matmul; int4/int8: offspec's kernels quantize activations to
    # 8 bits per block of 32 (as llama.cpp's do), so the logits agree to that precision, not bit for bit
    tol = 1e-4 if kind == "nf4" else 3e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    full = _passes(_reference(path))
    assert not torch.allclose(got[0], full[0], atol=1e-4)  # really quantized
    layer_bytes = handle.placement.sizes.layer_bytes
    unquantized = _offloaded(path, tmp_path, TIERS["part on SSD"])[1].placement.sizes.layer_bytes
    assert layer_bytes[0] < unquantized[0] / ratio  # fewer bytes to stream
    events.clear()
    _offloaded(path, tmp_path, TIERS["all from SSD"], quant=kind, progress=events.append)
    assert not any(e.step == "quantize" for e in events)  # quantized once, stored in the packed files


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_blocks_are_the_gguf_quantizers_output(four_layer_dirs, tmp_path, kind):
    """--quant int4/int8 stores exactly what gguf.quantize (llama.cpp's reference quantizer) makes of each weight."""
    from offspec.formats.modules import QLinear
    from offspec.formats.quantize import quantize_rows

    path = four_layer_dirs["llama"]
    model, _ = _offloaded(path, tmp_path, TIERS["all resident"], quant=kind)
    source = load_model(_resolved(path), device=CPU, dtype=torch.float32).model
    weights = dict(source.named_parameters())
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, QLinear) and name + ".weight" in weights:
            want = quantize_rows(weights[name + ".weight"], module.type_id)
            assert torch.equal(kernels.stored_rows(module).cpu(), want), name
            checked += 1
    assert checked >= 4 * 7  # every decoder linear (and the LM head)


def test_packed_set_is_reused_and_a_truncated_file_is_rebuilt(four_layer_dirs, tmp_path):
    path = four_layer_dirs["llama"]
    events = []
    _offloaded(path, tmp_path, TIERS["all from SSD"], progress=events.append)
    assert any(e.step == "pack" for e in events)
    events.clear()
    _, handle = _offloaded(path, tmp_path, TIERS["all from SSD"], progress=events.append)
    assert not any(e.step == "pack" for e in events)
    layer_file = handle.packed_dir / "layer-0002.bin"
    layer_file.write_bytes(layer_file.read_bytes()[:-4096])  # truncated
    events.clear()
    model, _ = _offloaded(path, tmp_path, TIERS["all from SSD"], progress=events.append)
    rebuild = [e for e in events if e.step == "pack"]
    assert rebuild and "truncated" in rebuild[0].message and "rebuilding" in rebuild[0].message
    assert all(torch.equal(a, b) for a, b in zip(_passes(model), _passes(_reference(path))))


def _flip_payload_byte(layer_file):
    data = bytearray(layer_file.read_bytes())
    data[4096 + 100] ^= 0xFF  # inside the payload: size and header stay valid
    layer_file.write_bytes(bytes(data))


def test_a_corrupt_streamed_file_is_a_one_line_error_and_rebuilt_next_start(four_layer_dirs, tmp_path):
    path = four_layer_dirs["llama"]
    _, first = _offloaded(path, tmp_path, TIERS["all from SSD"])
    first.streamer.close()
    _flip_payload_byte(first.packed_dir / "layer-0001.bin")
    model, handle = _offloaded(path, tmp_path, TIERS["all from SSD"])  # sizes and headers look fine
    with pytest.raises(OffspecError) as info:
        _passes(model)
    message = str(info.value)
    assert "\n" not in message and "layer-0001.bin is corrupt (checksum mismatch)" in message and "rebuilt" in message
    assert not (handle.packed_dir / "manifest.json").exists()  # marked for a rebuild
    handle.streamer.close()
    model, _ = _offloaded(path, tmp_path, TIERS["all from SSD"])
    assert all(torch.equal(a, b) for a, b in zip(_passes(model), _passes(_reference(path))))


def test_a_corrupt_resident_file_is_rebuilt_while_loading(four_layer_dirs, tmp_path):
    path = four_layer_dirs["qwen2"]
    _, first = _offloaded(path, tmp_path, TIERS["all resident"])
    _flip_payload_byte(first.packed_dir / "layer-0000.bin")
    events = []
    model, _ = _offloaded(path, tmp_path, ("device", "ram", "ssd", "ssd"), progress=events.append)
    assert any(e.step == "pack" and "rebuilding" in e.message for e in events)
    assert all(torch.equal(a, b) for a, b in zip(_passes(model), _passes(_reference(path))))


def test_an_interrupted_pass_does_not_desynchronize_the_stream(four_layer_dirs, tmp_path):
    path = four_layer_dirs["llama"]
    model, handle = _offloaded(path, tmp_path, TIERS["part on SSD"])
    layer2 = model.get_decoder().layers[2]

    def boom(module, args):
        raise KeyboardInterrupt

    hook = layer2.register_forward_pre_hook(boom)
    with pytest.raises(KeyboardInterrupt):
        _passes(model)
    hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(_passes(model), _passes(_reference(path))))
