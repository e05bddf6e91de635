"""`offspec models`: the cache listing (name, family, weight types, size, tokenizer fingerprint and who shares
one), `offspec models rm NAME` (exact names, one-line errors, removal by rename-aside, a default member's GGUF only
with --with-gguf), --json; and the tokenizer fingerprint read from tokenizer.json equal to the tokenizer's own.

Temp caches (OFFSPEC_CACHE_DIR) hold tiny GGUFs converted once per module (tests/helpers/tiny_gguf.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.chunks import chunked_spec
from helpers.tiny_gguf import save_tiny_gguf
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from offspec.cli.main import main
from offspec.errors import OffspecError
from offspec.models import catalog, default_pair
from offspec.models.catalog import list_cache, shared_tokenizers
from offspec.models.convert import ensure_converted
from offspec.models.draft_vocab import vocab_fingerprint
from offspec.models.fingerprint import file_fingerprint, fingerprint_vocab, tokenizer_json_vocab
from offspec.store.entry import MANIFEST, gguf_key
from offspec.util.hf import quiet_transformers
from offspec.util.sizes import format_size

DEFAULT_ROLE = "draft"  # the fake default member below stands in for the default draft


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict:
    """A cache with three converted tiny GGUFs: two qwen2 with one tokenizer, a llama with a wider vocabulary.
    qwen-a is converted under the key of a fake default draft (as ensure_converted names a default member)."""
    src = tmp_path_factory.mktemp("ggufs")
    root = tmp_path_factory.mktemp("pristine") / "cache"
    ggufs = {
        "qwen-a": save_tiny_gguf(src / "qwen-a.gguf", "qwen2", seed=0, layers=1),
        "qwen-b": save_tiny_gguf(src / "qwen-b.gguf", "qwen2", seed=0, layers=1, noise=0.01,
                                 types={"linear": "Q8_0"}),
        "llama-wide": save_tiny_gguf(src / "llama-wide.gguf", "llama", seed=1, layers=1, vocab_extra=16),
    }
    spec = chunked_spec(ggufs["qwen-a"].read_bytes(), 1, role=DEFAULT_ROLE, name="Tiny default", stem="tiny-default")
    names = {}
    for label, path in ggufs.items():
        key = spec.key if label == "qwen-a" else gguf_key(path)
        names[label] = ensure_converted(path, key=key, source=f"file {path}", root=root).name
    return {"root": root, "names": names, "ggufs": ggufs, "spec": spec}


@pytest.fixture
def cache(pristine, tmp_path, monkeypatch) -> SimpleNamespace:
    """A copy of the pristine cache as OFFSPEC_CACHE_DIR, qwen-a the default draft with its verified GGUF in gguf/,
    and a packed layer set in offload/."""
    root = tmp_path / "cache"
    shutil.copytree(pristine["root"], root)
    spec = pristine["spec"]
    gguf = default_pair.gguf_path(spec, root)
    gguf.parent.mkdir(parents=True)
    shutil.copyfile(pristine["ggufs"]["qwen-a"], gguf)
    default_pair._write_marker(gguf, spec)
    monkeypatch.setattr(default_pair, "DEFAULT_PAIR", {**default_pair.DEFAULT_PAIR, DEFAULT_ROLE: spec})
    packed = root / "offload" / "some-model-0123456789ab-bfloat16-nf4"
    packed.mkdir(parents=True)
    (packed / "layer-0000.bin").write_bytes(b"\0" * 8192)
    (packed / "manifest.json").write_text(json.dumps({"key": {"model": "org/some-model", "quant": "nf4",
                                                              "dtype": "bfloat16"}}))
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(root))
    return SimpleNamespace(root=root, names=pristine["names"])


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["models", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------
# the tokenizer fingerprint


def test_the_fingerprint_read_from_tokenizer_json_is_the_tokenizers_own(pristine):
    for name in pristine["names"].values():
        directory = pristine["root"] / "models" / name
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(directory)
        assert file_fingerprint(directory) == vocab_fingerprint(tokenizer)
        assert len(tokenizer_json_vocab(directory / "tokenizer.json")) == len(tokenizer.get_vocab())


def test_the_fingerprint_of_a_unigram_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram

    raw = Tokenizer(Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0), ("ab", -1.5)], unk_id=0))
    raw.add_special_tokens(["<eos>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert tokenizer_json_vocab(tmp_path / "tokenizer.json") == tokenizer.get_vocab()
    assert file_fingerprint(tmp_path) == vocab_fingerprint(tokenizer) == fingerprint_vocab(tokenizer.get_vocab())
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert file_fingerprint(tmp_path) is None


# ---------------------------------------------------------------------------------------------------------
# the listing


def test_list_names_family_types_size_and_shared_tokenizers(cache):
    names = cache.names
    rows = {r.name: r for r in list_cache(cache.root)}
    assert set(rows) == {*names.values(), "some-model-0123456789ab-bfloat16-nf4"}
    a, b, wide = rows[names["qwen-a"]], rows[names["qwen-b"]], rows[names["llama-wide"]]
    assert (a.family, b.family, wide.family) == ("qwen2", "qwen2", "llama")
    assert set(a.weight_types) == {"Q4_K", "Q6_K"} and "Q8_0" in b.weight_types
    manifest = json.loads((cache.root / "models" / names["qwen-b"] / MANIFEST).read_text())
    assert b.weight_types[0] == max(manifest["types"], key=manifest["types"].get)  # most bytes first
    assert a.size == tree_bytes(cache.root / "models" / names["qwen-a"]) and a.status == "ok"
    assert a.default_role == DEFAULT_ROLE and a.gguf_size == default_pair.DEFAULT_PAIR[DEFAULT_ROLE].size
    assert b.gguf == "" and b.gguf_size == 0
    assert a.tokenizer == b.tokenizer != wide.tokenizer and len(a.tokenizer) == 16
    assert shared_tokenizers(list(rows.values())) == {a.tokenizer: sorted([a.name, b.name])}
    packed = rows["some-model-0123456789ab-bfloat16-nf4"]
    assert (packed.kind, packed.weight_types, packed.size) == ("packed", ("nf4", "bfloat16"), tree_bytes(
        cache.root / "offload" / packed.name))


def test_list_table_and_json(cache, capsys):
    names = cache.names
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "TYPES", "SIZE", "GGUF", "TOKENIZER"]
    row = next(line for line in lines if line.startswith(names["qwen-a"]))
    fingerprint = next(r.tokenizer for r in list_cache(cache.root) if r.name == names["qwen-a"])
    assert row.split()[1:3] == ["qwen2", "Q4_K,Q6_K"] and row.endswith(f"{fingerprint[:8]}   default draft")
    assert any(line.startswith("same tokenizer (") and names["qwen-a"] in line and names["qwen-b"] in line
               and names["llama-wide"] not in line for line in lines)
    assert lines[-1].startswith("4 model(s), ") and str(cache.root) in lines[-1]

    for argv in (["--json"], ["list", "--json"]):
        code, out, _ = run(capsys, *argv)
        data = json.loads(out)
        assert code == 0 and data["cache_dir"] == str(cache.root)
        assert {m["name"] for m in data["models"]} == {*names.values(), "some-model-0123456789ab-bfloat16-nf4"}
        assert data["total_size"] == sum(m["total_size"] for m in data["models"])
        first = next(m for m in data["models"] if m["name"] == names["qwen-a"])
        assert first["family"] == "qwen2" and first["gguf_size"] > 0 and isinstance(first["weight_types"], list)
        assert list(data["shared_tokenizers"].values()) == [sorted([names["qwen-a"], names["qwen-b"]])]


def test_an_empty_cache_and_hidden_temps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "none"))
    code, out, _ = run(capsys)
    assert code == 0 and "no models in" in out and "offspec setup" in out
    (tmp_path / "none" / "models" / ".x.tmp-1-abc").mkdir(parents=True)  # a build in progress: not listed
    (tmp_path / "none" / "models" / "half").mkdir()  # no manifest: listed as incomplete
    rows = list_cache(tmp_path / "none")
    assert [(r.name, r.status) for r in rows] == [("half", "incomplete (no manifest)")]


# ---------------------------------------------------------------------------------------------------------
# rm


def test_rm_removes_an_entry_by_its_exact_name(cache, capsys):
    name = cache.names["llama-wide"]
    size = tree_bytes(cache.root / "models" / name)
    code, out, _ = run(capsys, "rm", name[:-1])  # a prefix is not a name
    assert code == 2 and (cache.root / "models" / name).is_dir()
    code, out, err = run(capsys, "rm", name)
    assert code == 0 and err == "" and out == f"removed {name} ({format_size(size)} freed)\n"
    assert not (cache.root / "models" / name).exists()
    left = sorted(p.name for p in (cache.root / "models").iterdir())
    assert left == sorted([cache.names["qwen-a"], cache.names["qwen-b"]])


def test_rm_an_unknown_name_is_one_line_and_removes_nothing(cache, capsys):
    before = sorted(str(p) for p in cache.root.rglob("*"))
    known = cache.names["qwen-b"]
    code, out, err = run(capsys, "rm", known, known[:-2] + "xx")
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(err.splitlines()) == 1
    assert f"no cached model named '{known[:-2]}xx'" in errors[0] and f"did you mean {known}" in errors[0]
    assert sorted(str(p) for p in cache.root.rglob("*")) == before  # the known name was not removed either


def test_rm_a_default_member_keeps_its_gguf_unless_asked(cache, capsys):
    name = cache.names["qwen-a"]
    gguf = default_pair.gguf_path(default_pair.DEFAULT_PAIR[DEFAULT_ROLE], cache.root)
    code, out, _ = run(capsys, "rm", name)
    assert code == 0 and "its GGUF stays" in out and "--with-gguf" in out
    assert not (cache.root / "models" / name).exists() and gguf.is_file()
    row = next(r for r in list_cache(cache.root) if r.name == name)  # still listed: the GGUF alone
    assert (row.kind, row.size, row.gguf_size) == ("gguf", 0, gguf.stat().st_size)
    assert default_pair.assembled_gguf(default_pair.DEFAULT_PAIR[DEFAULT_ROLE], cache.root) == gguf  # still trusted

    code, out, err = run(capsys, "rm", name)
    assert code == 2 and "add --with-gguf" in err and gguf.is_file()
    code, out, err = run(capsys, "rm", name, "--with-gguf", "--json")
    assert code == 0 and json.loads(out)["removed"] == [{"name": name, "freed": row.gguf_size}]
    assert sorted(p.name for p in gguf.parent.iterdir()) == []  # the GGUF and its sidecar
    assert name not in {r.name for r in list_cache(cache.root)}


def test_rm_of_several_names_checks_them_all_first(cache, capsys):
    name, other = cache.names["qwen-a"], cache.names["qwen-b"]
    assert run(capsys, "rm", name)[0] == 0  # the default member's GGUF stays, as a row of its own
    code, _, err = run(capsys, "rm", other, name)  # the GGUF row needs --with-gguf: nothing is removed
    assert code == 2 and "add --with-gguf" in err and (cache.root / "models" / other).is_dir()


def test_rm_with_gguf_removes_entry_and_gguf_at_once(cache, capsys):
    name = cache.names["qwen-a"]
    total = next(r for r in list_cache(cache.root) if r.name == name).total_size
    code, out, _ = run(capsys, "rm", "--with-gguf", name, "--json")
    assert code == 0 and json.loads(out)["freed"] == total
    assert not (cache.root / "models" / name).exists() and list((cache.root / "gguf").iterdir()) == []


def test_a_gguf_of_no_default_member_is_listed_and_removed_with_the_flag(cache, capsys):
    stray = cache.root / "gguf" / "old-default.gguf"
    stray.write_bytes(b"GGUF" + b"\0" * 100)
    row = next(r for r in list_cache(cache.root) if r.name == "old-default.gguf")
    assert (row.kind, row.gguf_size, row.status) == ("gguf", 104, "not a default pair member of this version")
    assert run(capsys, "rm", "old-default.gguf")[0] == 2 and stray.is_file()
    assert run(capsys, "rm", "old-default.gguf", "--with-gguf")[0] == 0 and not stray.exists()


def test_rm_a_packed_set(cache, capsys):
    code, out, _ = run(capsys, "rm", "some-model-0123456789ab-bfloat16-nf4")
    assert code == 0 and list((cache.root / "offload").iterdir()) == []


def test_an_interrupted_rm_leaves_nothing_usable(cache, monkeypatch):
    name = cache.names["qwen-b"]
    rows = list_cache(cache.root)

    def interrupted(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        catalog.remove(catalog.find(rows, name))
    assert not (cache.root / "models" / name).exists()  # renamed aside before the deletion began
    hidden = [p.name for p in (cache.root / "models").iterdir() if p.name.startswith(f".{name}.trash-")]
    assert len(hidden) == 1 and name not in {r.name for r in list_cache(cache.root)}


def test_find_is_exact(cache):
    rows = list_cache(cache.root)
    with pytest.raises(OffspecError, match="no cached model named"):
        catalog.find(rows, cache.names["qwen-b"].upper())


def test_self_draft_copies_are_listed_with_their_type_and_removed_marker_first(cache, capsys):
    from offspec.models.self_draft import copy_path, self_copy

    target = save_tiny_gguf(cache.root.parent / "target.gguf", "qwen2", seed=0, layers=1)
    copy = self_copy(target, "Q2_K", root=cache.root)
    assert copy == copy_path(target, "Q2_K", cache.root)
    row = next(r for r in list_cache(cache.root) if r.kind == "self")
    assert (row.name, row.weight_types, row.size, row.status) == (copy.name, ("Q2_K",), copy.stat().st_size, "ok")
    code, out, _ = run(capsys)
    assert code == 0 and any(line.startswith(copy.name) and "--draft self" in line for line in out.splitlines())
    (copy.with_name(copy.name + ".built")).write_text("{}")  # a marker that no longer names the file
    assert next(r for r in list_cache(cache.root) if r.kind == "self").status.startswith("incomplete")
    code, out, _ = run(capsys, "rm", copy.name)
    assert code == 0 and out.startswith(f"removed {copy.name}")
    assert not copy.exists() and not copy.with_name(copy.name + ".built").exists()
    assert all(r.kind != "self" for r in list_cache(cache.root))
