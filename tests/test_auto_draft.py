"""A draft for any target (offspec/models/auto_draft.py): with a target and no draft, a cached model with the
target's tokenizer, else the default draft through the mapping, else suffix drafts; the load line says which."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers.tiny import save_tiny_model
from helpers.tiny_vocab import TARGET_MERGES, merged_tokenizer, save_with_tokenizer

import offspec
from offspec.models import auto_draft, loading
from offspec.models.loading import load_pair, load_tokenizer
from offspec.models.sources import ResolvedModel, locate_model
from offspec.store.entry import FORMAT_VERSION, entry_files, write_manifest
from offspec.util.files import sha256_file

SMALL = dict(hidden=32, layers=1, heads=2, kv_heads=1)


def make_entry(cache: Path, key: str, model_dir: Path, source: str) -> Path:
    """A converted cache entry (float weights) holding `model_dir`'s files, with its manifest."""
    directory = cache / "models" / key
    shutil.copytree(model_dir, directory)
    files = []
    for rel in entry_files(directory):
        st = (directory / rel).stat()
        files.append({"name": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                      "sha256": sha256_file(directory / rel)})
    write_manifest(directory, {"format": FORMAT_VERSION, "source": source, "weights": "float32", "files": files})
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto-draft-models")
    return {
        "target": save_tiny_model(root / "target", arch="llama", seed=0, logit_scale=3.0),
        "small": save_tiny_model(root / "small", arch="llama", seed=0, logit_scale=3.0, noise=0.02, **SMALL),
        "mid": save_tiny_model(root / "mid", arch="qwen2", seed=1, hidden=48, layers=2, heads=4, kv_heads=2),
        "big": save_tiny_model(root / "big", arch="llama", seed=2, hidden=128, layers=2),
        "other": save_with_tokenizer(root / "other", merged_tokenizer(TARGET_MERGES, seed=3, ascii_only=True),
                                     arch="llama", seed=3, **SMALL),
    }


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    (root / "models").mkdir(parents=True)
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return root


def choose(target_dir: Path):
    located = locate_model(str(target_dir), "target")
    return auto_draft.choose_draft(located, load_tokenizer(located), load_tokenizer)


def test_the_smallest_cached_model_with_the_targets_tokenizer_is_chosen(models, cache):
    for name in ("mid", "big", "other", "small"):  # "other" is the smallest, with another tokenizer
        make_entry(cache, f"{name}-0123456789ab", models[name], f"hub tiny/{name}")
    sizes = {m.name: size for size, m in auto_draft.cached_entries(root=cache)}
    assert sizes["tiny/other"] < sizes["tiny/small"] < sizes["tiny/mid"] < sizes["tiny/big"]
    choice = choose(models["target"])
    assert choice.draft.path == cache / "models" / "small-0123456789ab" and choice.draft.name == "tiny/small"
    assert choice.line == (f"draft tiny/small: the smallest cached model with the tokenizer of target "
                           f"({choice.draft.path})")
    # the target itself is never its own draft, nor a model as big as it
    itself = choose(cache / "models" / "small-0123456789ab")
    assert itself.draft is None and itself.line.startswith("no draft model: no smaller cached model has the "
                                                           "tokenizer of small-0123456789ab")


@pytest.mark.slow
def test_a_target_without_a_draft_loads_with_the_chosen_one(models, cache):
    make_entry(cache, "small-0123456789ab", models["small"], f"file {models['small']}/small.gguf")
    events = []
    gen = offspec.load(str(models["target"]), dtype="float64", max_context=128, max_budget=64,
                       progress=events.append)
    assert gen.info.draft == "small" and "draft_mapping" not in gen.info.extra  # the same tokenizer: no mapping
    assert [e.message for e in events if e.step == "draft"] == [
        f"draft small: the smallest cached model with the tokenizer of target ({cache}/models/small-0123456789ab)"]
    plain = gen.generate("Hello", max_new_tokens=24, speculate=False)
    spec = gen.generate("Hello", max_new_tokens=24, budget=16, drafter="model")
    assert spec.token_ids == plain.token_ids and sum(p.tree_size for p in spec.passes) > 0


def test_without_a_cached_draft_or_the_default_one_it_is_suffix_drafts(models, cache):
    make_entry(cache, "other-0123456789ab", models["other"], "hub tiny/other")  # another tokenizer only
    events = []
    gen = offspec.load(str(models["target"]), max_context=128, max_budget=64, progress=events.append)
    assert gen.info.draft == "none" and gen.tree.drafter == "suffix" and gen.engine.drafter.runner is None
    line = next(e.message for e in events if e.step == "draft")
    assert line.startswith("no draft model: no smaller cached model has the tokenizer of target, and the default "
                           "draft is not") and "suffix drafts only" in line


def test_the_default_draft_comes_next_through_the_mapping(models, cache, monkeypatch):
    make_entry(cache, "other-0123456789ab", models["other"], "hub tiny/other")
    default = ResolvedModel(name="the default draft", path=models["other"], kind="default")
    monkeypatch.setattr(auto_draft, "_bytes_on_disk", lambda path: 10**12)  # a target bigger than the default draft
    monkeypatch.setattr(auto_draft, "_default_draft_installed", lambda: True)
    monkeypatch.setattr(auto_draft, "locate_model", lambda spec, role, progress=None: default)
    choice = choose(models["target"])
    assert choice.draft is default
    assert choice.line.endswith("no smaller cached model has the tokenizer of target, so the default draft")
    monkeypatch.setattr(auto_draft, "_default_draft_installed", lambda: False)
    none = choose(models["target"])
    assert none.draft is None and "the default draft is not installed" in none.line


def test_no_target_is_the_default_pair_as_before(models, monkeypatch):
    """Without --target nothing is chosen: the default draft serves the default target."""
    located = {"target": ResolvedModel(name="t", path=models["target"], kind="local"),
               "draft": ResolvedModel(name="d", path=models["small"], kind="local")}
    monkeypatch.setattr(loading, "locate_model", lambda spec, role, progress=None, target=None: located[role])
    monkeypatch.setattr(loading, "choose_draft", lambda *a, **k: pytest.fail("no choice without a target"))
    events = []
    _, draft = load_pair(None, None, device="cpu", dtype=torch.float32, progress=events.append)
    assert draft.name == "d" and not [e for e in events if e.step == "draft"]
