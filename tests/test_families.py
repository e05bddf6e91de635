"""Every model family offspec runs from a GGUF: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3.

Tier 2: a tiny random GGUF per family, laid out as llama.cpp writes it (tests/helpers/tiny_gguf.py), converted with
its blocks kept, then:
- with exact weights (the torch fallback: blocks decoded, float products), its logits are transformers' own model
  of the same file, bit for bit (the config completed as llama.cpp reads the file: offspec.formats.gguf_config);
- the compiled CPU layer computes what transformers' layer computes on the same low-bit kernels;
- greedy output is the same resident, streamed (every layer from SSD) and speculative.
Sliding windows are reached: the prompts are longer than the gemma files' window of 8.
The real GGUFs (SmolLM2, Gemma 3) against llama.cpp are tests/test_real_ggufs.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.references import causal, transformers_reference
from helpers.tiny_gguf import FAMILIES, save_tiny_gguf

import offspec
from offspec import OffspecError
from offspec.formats import kernels
from offspec.formats.gguf_config import complete_config
from offspec.store.entry import MANIFEST, converted_dir, gguf_key

LOAD = dict(max_context=256, max_budget=64)
PROMPT = [5, 9, 33, 70, 71, 72, 100, 3, 44, 120, 7, 18, 64, 90, 91, 92, 93, 94, 95, 96, 40, 41]  # > the window
# per family: what its tiny file needs (qwen3: a head dimension that is not hidden / heads)
SHAPE = {"qwen3": dict(head_dim=128)}
# a Mistral GGUF is a llama file (llama.cpp writes it so); transformers and offspec read it as llama
RUNS_AS = {"mistral": "llama"}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("family-ggufs")
    out = {}
    for family in FAMILIES:
        out[family] = save_tiny_gguf(root / f"{family}.gguf", family, seed=0, **SHAPE.get(family, {}))
        # 8 layers: the smallest --device-mem keeps a few, and streams the others from SSD
        out[family + "-deep"] = save_tiny_gguf(root / f"{family}-deep.gguf", family, seed=0, layers=8,
                                               **SHAPE.get(family, {}))
        out[family + "-draft"] = save_tiny_gguf(root / f"{family}-draft.gguf", family, seed=0, layers=8,
                                                noise=0.002, **SHAPE.get(family, {}))
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_converts_with_its_blocks_and_computes_what_transformers_computes(cache, ggufs, family,
                                                                                   monkeypatch):
    import gguf as gguf_py

    monkeypatch.setattr(kernels, "_ext", None)  # exact weights: blocks decoded, float products
    monkeypatch.setattr(kernels, "_failure", "OFFSPEC_KERNELS=torch")
    gen = offspec.load(str(ggufs[family]), "none", budget=4, **LOAD)
    manifest = json.loads((converted_dir(gguf_key(ggufs[family])) / MANIFEST).read_text())
    reader = gguf_py.GGUFReader(str(ggufs[family]))
    quantized = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name != "F32")
    assert manifest["weights"] == "ggml" and sum(manifest["types"].values()) == quantized  # every block, as it is
    assert gen.info.extra["family"] == RUNS_AS.get(family, family) and gen.info.extra["verified"] is True
    runner = gen.engine.target
    got = runner.logits(causal(runner, PROMPT))  # (q, V)
    with torch.no_grad():
        want = transformers_reference(ggufs[family])(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_layer_computes_the_familys_layer(cache, ggufs, family):
    gen = offspec.load(str(ggufs[family]), "none", budget=4, **LOAD)
    runner = gen.engine.target
    assert runner.layers_unsupported is None and gen.info.extra["layers"] == "compiled"
    got = causal(runner, PROMPT)
    runner.layers_unsupported = "off for the test"  # transformers' layers, on the same kernels and exact attention
    want = causal(runner, PROMPT)
    # the same operations; a last bit of difference in a norm may move an 8-bit activation rounding, no more
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    # and the low-bit model stays near the float one (its 8-bit activations are the only difference)
    with torch.no_grad():
        reference = transformers_reference(ggufs[family])(torch.tensor([PROMPT])).logits[0]
    logits = runner.logits(got)
    assert (logits - reference).abs().max() <= 0.2 * reference.abs().max()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("family", [f if f in ("llama", "gemma3") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # the quick lane: llama and the family whose bug this found
def test_greedy_is_the_same_resident_streamed_and_speculative(cache, ggufs, family, tmp_path):
    target, draft = str(ggufs[family + "-deep"]), str(ggufs[family + "-draft"])
    resident = offspec.load(target, draft, **LOAD)
    plain = resident.generate(PROMPT, max_new_tokens=40, speculate=False)
    assert len(plain.token_ids) > 8  # past the window
    with pytest.raises(OffspecError) as info:  # the smallest budget offspec accepts streams every layer
        offspec.load(target, draft, device_mem="1KB", offload_dir=str(tmp_path), **LOAD)
    budget = re.search(r"--device-mem (\S+)", str(info.value))[1]
    streamed = offspec.load(target, draft, device_mem=budget, offload_dir=str(tmp_path), **LOAD)
    assert streamed.info.extra["placement"]["layers"]["ssd"] >= 1
    assert streamed.info.extra["layers"] == "compiled"
    assert streamed.generate(PROMPT, max_new_tokens=40, speculate=False).token_ids == plain.token_ids
    accepted = 0
    for gen in (resident, streamed):
        for nodes in (1, 16):
            result = gen.generate(PROMPT, max_new_tokens=40, budget=nodes)
            assert result.token_ids == plain.token_ids, (gen is streamed, nodes)
            accepted += sum(p.accepted for p in result.passes)
    assert accepted > 0  # the draft was right often enough to exercise acceptance
    streamed.engine.target.io.close()


def test_the_load_line_names_the_family_and_how_its_layers_run(cache, ggufs, monkeypatch):
    events = []
    offspec.load(str(ggufs["gemma3"]), "none", budget=4, progress=events.append, **LOAD)
    assert any(e.message.endswith("gemma3 family, compiled CPU layer") for e in events)
    monkeypatch.setenv("OFFSPEC_LAYERS", "transformers")
    events.clear()
    offspec.load(str(ggufs["phi3"]), "none", budget=4, progress=events.append, **LOAD)
    assert any("phi3 family, transformers' layers (OFFSPEC_LAYERS=transformers)" in e.message for e in events)


def test_a_family_outside_the_verified_ones_says_so_on_its_load_line():
    from offspec.api import load_line

    from offspec.api import _family

    config = type("Config", (), {"model_type": "starcoder2"})()
    family, verified = _family(config)
    line = load_line("x", {"family": family, "verified": verified, "layers": "Starcoder2DecoderLayer is not ..."})
    assert family == "starcoder2" and "not verified against a reference (offspec verifies gemma2" in line
    assert line.endswith("check its output")
    assert "not verified" not in load_line("x", {"family": "qwen3", "verified": True, "layers": "compiled"})
    config = type("Config", (), {"model_type": "phi3", "offspec_unverified": "its longrope factors ..."})()
    assert _family(config) == ("phi3", "its longrope factors ...")  # a verified family, this file not


def test_the_config_is_completed_as_llama_cpp_reads_the_file():
    """What transformers' GGUF reader leaves at its config class's defaults."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    config = Gemma2Config(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    changed = complete_config(config, {"general.architecture": "gemma2", "gemma2.attn_logit_softcapping": 40.0})
    assert config.query_pre_attn_scalar == 144 and config.attn_logit_softcapping == 40.0  # the 27B's scale
    assert "query_pre_attn_scalar=144" in changed
    config = Gemma3TextConfig(num_hidden_layers=4, head_dim=64)
    complete_config(config, {"general.architecture": "gemma3", "gemma3.attention.key_length": 64})
    assert config.query_pre_attn_scalar == 64 and config.layer_types == ["full_attention"] * 4  # no window: global
    config = Gemma3TextConfig(num_hidden_layers=4, head_dim=64)
    complete_config(config, {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 16,
                             "gemma3.attention.sliding_window_pattern": 2, "gemma3.rope.freq_base_swa": 5000.0})
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 16
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
    config = Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=128)
    complete_config(config, {"general.architecture": "qwen3", "qwen3.attention.key_length": 64})
    assert config.head_dim == 64
    config = Phi3Config(hidden_size=3072, num_attention_heads=24, sliding_window=2047)
    complete_config(config, {"general.architecture": "phi3", "phi3.rope.dimension_count": 96})
    assert config.rope_parameters["partial_rotary_factor"] == 0.75 and config.sliding_window is None


def test_a_mistral_window_over_every_layer_is_applied(cache, tmp_path):
    """A Mistral checkpoint with a sliding window (llama.cpp runs Mistral GGUFs without one, as llama files; a
    transformers checkpoint keeps it): offspec's passes attend within it, as transformers' own forward does."""
    from helpers.tiny import make_tokenizer, tiny_config
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    known = MistralConfig().to_dict()
    config = MistralConfig(**{k: v for k, v in tiny_config("llama").to_dict().items() if k in known})
    config.sliding_window = 6
    model = MistralForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "mistral")
    make_tokenizer().save_pretrained(tmp_path / "mistral")
    gen = offspec.load(str(tmp_path / "mistral"), "none", budget=4, **LOAD)
    runner = gen.engine.target
    assert runner.windows == [6, 6]
    got = runner.logits(causal(runner, PROMPT))
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
        unwindowed = MistralForCausalLM(MistralConfig(**{**config.to_dict(), "sliding_window": None}))
        unwindowed.load_state_dict(model.state_dict())
        full = unwindowed.float().eval()(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert not torch.allclose(got[-1], full[-1], rtol=1e-3, atol=1e-3)  # the window changed the last rows


# --- bad input: one line, nothing in the cache ----------------------------------------------------


def _one_tensor_gguf(path, arch: str, type_name: str):
    """A GGUF holding one (8, 256) tensor of `type_name` (random bytes): enough for the checks made before any
    conversion."""
    import gguf as gguf_py
    import numpy as np

    qt = gguf_py.GGMLQuantizationType[type_name]
    block, nbytes = gguf_py.GGML_QUANT_SIZES[qt]
    w = gguf_py.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).integers(0, 256, (8, 256 // block * nbytes),
                                                                         dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, type_name, says", [
    ("fancy9", "Q4_0", "has the architecture 'fancy9', which offspec cannot run"),
    ("llama", "Q8_K", "holds token_embd.weight as Q8_K, a ggml type no offspec code path can read"),
])
def test_an_unknown_architecture_or_an_unreadable_type_is_one_line_and_leaves_the_cache_alone(
        tmp_path, arch, type_name, says):
    import subprocess
    import sys
    from pathlib import Path

    bad = _one_tensor_gguf(tmp_path / "bad.gguf", arch, type_name)
    cache = tmp_path / "cache"
    root = Path(__file__).parent.parent
    env = {**__import__("os").environ, "OFFSPEC_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, str(root / "main.py"), "generate", "--target", str(bad), "--draft", "none",
                           "--raw", "hi"], capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


@pytest.mark.parametrize("path", ["blocks", "float"])
def test_a_tensor_the_model_has_no_place_for_is_an_error_never_dropped(cache, tmp_path, monkeypatch, path):
    """The import of either path (blocks kept, or the float fallback through transformers' loader, which skips a
    tensor it has no name for) refuses a file with a tensor it would not use, and leaves no cache entry."""
    stray = save_tiny_gguf(tmp_path / "stray.gguf", arch="llama",
                           extra={"blk.1.ffn_extra.weight": torch.ones(8).numpy()})
    if path == "float":  # as for an architecture whose tensors need more than a row reorder
        monkeypatch.setattr("offspec.formats.gguf_import._ROW_SAFE_PROCESSORS", ())
    with pytest.raises(OffspecError) as info:
        offspec.load(str(stray), "none", **LOAD)
    assert str(info.value) == ("stray.gguf: its tensor blk.1.ffn_extra.weight has no place in transformers' llama "
                               "model, so offspec cannot run the file whole; use a GGUF that llama.cpp's "
                               "convert_hf_to_gguf.py writes for a supported family")
    models = cache / "models"
    assert not models.exists() or not [p for p in models.iterdir() if (p / MANIFEST).exists()]


def test_llama3_rope_factors_in_the_file_become_the_rope_parameters_that_reproduce_them(cache, tmp_path):
    """Llama 3.1+ GGUFs hold their rope frequency factors as a tensor, which transformers' reader skips: offspec
    sets the llama3 rope parameters that give the same frequencies (as llama.cpp applies the tensor)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from offspec.formats.gguf_config import llama3_factors

    factors = llama3_factors(10000.0, 64, 8.0, 1.0, 4.0, 8192)  # (32,): head_dim 64
    assert 1.0 < factors.max() == 8.0 and factors.min() == 1.0  # the tiny head reaches all three regions
    path = save_tiny_gguf(tmp_path / "llama31.gguf", "llama", rope_freqs=factors)
    events = []
    gen = offspec.load(str(path), "none", budget=4, progress=events.append, **LOAD)
    assert any("llama3 rope (factor 8" in e.message for e in events)
    config = AutoConfig.from_pretrained(str(converted_dir(gguf_key(path))))
    assert config.rope_parameters["rope_type"] == "llama3"
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    torch.testing.assert_close(inv_freq.double(), base / torch.from_numpy(factors), rtol=1e-6, atol=0)
    assert gen.generate(PROMPT, max_new_tokens=4, speculate=False).token_ids


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_rope_factors_offspec_cannot_reproduce_convert_and_say_so_on_the_load_line(cache, tmp_path, family):
    """Frequency factors that match no llama3 rope parameters (llama), and phi3's longrope factors (Phi-3 128k,
    Phi-3.5, Phi-4-mini): converted with the blocks kept, the load line says the file is not verified."""
    import numpy as np

    factors = np.linspace(1.0, 3.0, 32 if family == "llama" else 16)  # (head_dim / 2,) of the tiny head
    path = save_tiny_gguf(tmp_path / f"{family}.gguf", family, rope_freqs=factors)
    events = []
    gen = offspec.load(str(path), "none", budget=4, progress=events.append, **LOAD)
    assert "rope" in gen.info.extra["verified"]
    assert json.loads((converted_dir(gguf_key(path)) / MANIFEST).read_text())["weights"] == "ggml"
    assert any("not verified against a reference" in e.message and "rope" in e.message for e in events)


def test_raw_sends_the_prompt_as_it_is_as_completions_do(cache, ggufs):
    from offspec.cli.main import _parser

    gen = offspec.load(str(ggufs["qwen2"]), "none", budget=4, **LOAD)
    raw = gen.generate("Hello", raw=True, max_new_tokens=4, speculate=False)
    chat = gen.generate("Hello", max_new_tokens=4, speculate=False)
    assert raw.prompt_tokens == len(gen.tokenize("Hello")) < chat.prompt_tokens  # no chat template around it
    assert gen.generate(gen.tokenize("Hello"), max_new_tokens=4, speculate=False).token_ids == raw.token_ids
    with pytest.raises(OffspecError, match="raw=True takes a text prompt"):
        gen.generate([{"role": "user", "content": "Hello"}], raw=True, max_new_tokens=4)
    assert _parser().parse_args(["generate", "--raw", "Hello"]).raw
