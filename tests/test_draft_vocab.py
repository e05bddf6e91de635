"""The draft's reduced vocabulary (offspec/models/draft_vocab.py): which rows are kept, the reduced head's numbers and
memory, and that a draft proposing only those tokens leaves the output exactly the target's (greedy and sampled).

Tiers 1-2: a fake tokenizer and ranks tables in a temp config dir; random ggml rows; tiny GGUF and float pairs."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from helpers.sampling import MESSAGES, chi_square, exact_two_token_distribution
from helpers.tiny import make_tokenizer
from helpers.tiny_gguf import mapped_file, random_blocks, save_tiny_gguf

import offspec
from offspec import OffspecError
from offspec.config import LoadConfig, SamplingConfig
from offspec.formats import kernels
from offspec.formats.modules import QLinear
from offspec.models.draft_vocab import (RANKS_FORMAT, SubsetHead, choose_ids, find_ranks, head_rows, reduce_draft_head,
                                        restrict_head, vocab_fingerprint)

LOAD = dict(max_context=256, max_budget=64)


class FakeTokenizer:
    def __init__(self, n: int, special=(0, 1)):
        self.vocab = {f"t{i}": i for i in range(n)}
        self.all_special_ids = list(special)
        self.added_tokens_decoder = {}

    def get_vocab(self):
        return dict(self.vocab)


def write_table(config_dir, tokenizer, ids, name="ranks.json") -> None:
    where = config_dir / "token_ranks"
    where.mkdir(parents=True, exist_ok=True)
    data = {"format": RANKS_FORMAT, "version": 1, "tokenizer": vocab_fingerprint(tokenizer), "ids": list(ids)}
    (where / name).write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


# --- which rows ----------------------------------------------------------------------------------


def test_the_most_frequent_tokens_and_the_special_ones_are_kept(config_dir):
    tok = FakeTokenizer(50, special=(0, 49))
    write_table(config_dir, tok, [7, 3, 9, 30, 2, 11])
    assert choose_ids(tok, 4, 50).tolist() == [0, 3, 7, 9, 30, 49]  # top 4, ascending, with the specials
    assert choose_ids(tok, "full", 50) is None
    assert choose_ids(tok, 50, 50) is None  # as many as the head has: the whole head
    assert choose_ids(tok, "auto", 50) is None  # auto keeps 65,536: more than this head has
    assert choose_ids(tok, 4, 10).tolist() == [0, 3, 7, 9]  # ids past the head's rows are left out


def test_auto_needs_a_table_for_this_tokenizer_and_a_count_says_so(config_dir):
    tok, other = FakeTokenizer(100_000), FakeTokenizer(100_001)
    write_table(config_dir, other, range(70_000))  # another vocabulary's table is never used
    assert find_ranks(vocab_fingerprint(tok)) is None
    assert choose_ids(tok, "auto", 100_000) is None
    with pytest.raises(OffspecError, match="no token ranks table matches"):
        choose_ids(tok, 1000, 100_000)
    write_table(config_dir, tok, range(99_999, -1, -1), name="mine.json")
    ids = choose_ids(tok, "auto", 100_000)
    assert ids.numel() == 65536 + 2 and ids[-1] == 99_999 and ids[0] == 0  # the 65,536 most frequent + specials


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": RANKS_FORMAT, "tokenizer": "x", "ids": [1, 1]}),
                                     json.dumps({"format": RANKS_FORMAT, "tokenizer": "x", "ids": [-1]})])
def test_a_malformed_table_is_one_line_naming_it(config_dir, content):
    (config_dir / "token_ranks").mkdir(parents=True)
    (config_dir / "token_ranks" / "bad.json").write_text(content, encoding="utf-8")
    with pytest.raises(OffspecError) as info:
        find_ranks("anything")
    assert "bad.json" in str(info.value) and "scripts/token_ranks.py" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["0", "-3", "many", 0, True, "32k"])
def test_a_bad_setting_is_one_line_before_loading(value):
    with pytest.raises(OffspecError, match="draft_vocab"):
        LoadConfig(draft_vocab=value).validate()


def test_the_cli_flag_reaches_the_loader():
    from offspec.cli.args import load_options
    from offspec.cli.main import _parser

    args = _parser().parse_args(["generate", "--draft-vocab", "4096", "hi"])
    assert load_options(args)["draft_vocab"] == "4096"  # checked by LoadConfig (a bad value: test_cli_robust)


# --- the reduced head ----------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_the_reduced_head_gives_the_full_heads_rows_bit_for_bit(type_name):
    rng = np.random.default_rng(0)
    head = QLinear(__import__("gguf").GGMLQuantizationType[type_name].value, 256, 300, False, torch.device("cpu"))
    head.qweight = torch.from_numpy(random_blocks(rng, type_name, 300, 256))
    ids = torch.tensor([0, 5, 17, 128, 299])
    sub = SubsetHead(head, ids, 300, extra=3)
    x = torch.randn(7, 256)
    full = head(x)  # (7, 300)
    assert torch.equal(sub.subset(x), full[:, ids])  # the kernels are row invariant: the same bits
    out = sub(x)  # (7, 300): the model's own forward proposes only the kept tokens
    assert torch.equal(out[:, ids], full[:, ids])
    others = torch.ones(300, dtype=torch.bool)
    others[ids] = False
    assert torch.isinf(out[:, others]).all() and (out[:, others] < 0).all()
    # tokens the conversation uses get rows, up to `extra`; known ones and ids past the head are skipped
    assert sub.admit([17, 40, 40, 301, 3, 250, 251]) == 3
    assert sub.token_ids.tolist() == [0, 5, 17, 128, 299, 3, 40, 250]
    assert torch.equal(sub.subset(x), full[:, sub.token_ids])
    assert sub.admit([7]) == 0  # no rows left
    sub.forget()
    assert sub.token_ids.tolist() == ids.tolist() and sub.admit([7]) == 1


@pytest.mark.parametrize("layout,gather", [("auto", 4096), ("auto", 16), ("rows", 16)])
def test_a_reduced_heads_rows_chosen_at_load_are_interleaved_and_give_the_same_bits(layout, gather, monkeypatch):
    """On a CPU with the compiled kernels, the rows chosen at load are interleaved 16 at a time (two groups and 5
    rows here), from an interleaved head or from its store's rows; the admitted rows stay row-major after them.
    Gathered 16 rows at a time (three chunks here) or all at once, the same bits."""
    monkeypatch.setenv(kernels.LAYOUT_VARIABLE, layout)
    monkeypatch.setattr("offspec.models.draft_vocab.GATHER_ROWS", gather)
    rng = np.random.default_rng(1)
    tid = __import__("gguf").GGMLQuantizationType["Q8_0"].value
    raw = torch.from_numpy(random_blocks(rng, "Q8_0", 300, 256))  # (300, row_bytes)
    head = QLinear(tid, 256, 300, True, torch.device("cpu"))
    head.qweight.copy_(raw)
    head.bias.copy_(torch.randn(300))
    x = torch.randn(5, 256)
    full = head(x)  # (5, 300)
    interleaved = layout == "auto" and kernels.interleaves()
    assert kernels.interleave(head) == interleaved  # a resident head's rows, as materialize leaves them
    ids = torch.arange(0, 296, 8)  # (37,)
    for source in (None, raw):
        sub = SubsetHead(head, ids, 300, source=source, extra=4)
        assert sub.static_interleaved == interleaved
        assert torch.equal(sub.subset(x), full[:, ids])
        assert sub.admit([3, 299, 8]) == 2
        assert torch.equal(sub.subset(x), full[:, sub.token_ids])
        assert torch.equal(sub(x)[:, sub.token_ids], full[:, sub.token_ids])


def test_a_reduced_head_gathered_from_a_file_mapping_lets_its_pages_go_and_keeps_every_row(tmp_path, monkeypatch):
    """A store's full head, memory-mapped: the pages read for each chunk go as the gathering moves on (so the whole
    head is never resident at once); later admissions read their rows again from the file, the same bytes."""
    import mmap

    monkeypatch.setattr("offspec.models.draft_vocab.GATHER_ROWS", 16)
    rng = np.random.default_rng(2)
    tid = __import__("gguf").GGMLQuantizationType["Q8_0"].value
    raw = torch.from_numpy(random_blocks(rng, "Q8_0", 4096, 256))  # (4096, 272): 1.1 MB, 272 pages
    (tmp_path / "head.bin").write_bytes(raw.numpy().tobytes())
    with open(tmp_path / "head.bin", "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    source = torch.frombuffer(mapping, dtype=torch.uint8).view(raw.shape)  # (4096, 272) read-only file pages
    released = []
    advise = __import__("offspec.models.draft_vocab", fromlist=["advise"]).advise
    monkeypatch.setattr("offspec.models.draft_vocab.advise", lambda v, a: (released.append(v.shape[0]), advise(v, a)))
    head = QLinear(tid, 256, 4096, False, torch.device("cpu"))
    head.qweight.copy_(raw)
    ids = torch.arange(0, 4096, 7)  # (586,) ascending
    sub = SubsetHead(head, ids, 4096, source=source, extra=8, source_mapped=True)
    assert released == sorted(released) and len(released) == -(-586 // 16) and released[-1] == int(ids[-1])
    x = torch.randn(3, 256)
    full = head(x)  # (3, 4096)
    assert torch.equal(sub.subset(x), full[:, ids])
    assert sub.admit([1, 4094, 2000]) == 3  # rows read again from the file, after their pages went
    assert torch.equal(sub.subset(x), full[:, sub.token_ids])
    released.clear()
    SubsetHead(head, ids, 4096, source=raw, extra=8)  # an ordinary tensor: never advised (DONTNEED would zero it)
    assert released == []


def test_a_new_conversation_refreshes_a_head_half_full_of_earlier_tokens():
    from types import SimpleNamespace

    from offspec.spec.runner import ModelRunner

    head = torch.nn.Linear(4, 40, bias=False)
    sub = SubsetHead(head, torch.tensor([0, 1]), 40, extra=8)
    runner = SimpleNamespace(subset_head=sub)
    sub.admit([10, 11, 12, 13])
    ModelRunner.refresh_tokens(runner, [20, 21])  # 4 of 8 extra rows used: not more than half, kept
    assert sub.token_ids.tolist() == [0, 1, 10, 11, 12, 13]
    sub.admit([14])
    ModelRunner.refresh_tokens(runner, [20, 21, 1])  # 5 of 8: start over from the conversation kept
    assert sub.token_ids.tolist() == [0, 1, 20, 21]
    x = torch.randn(3, 4)
    assert torch.allclose(sub.subset(x), head(x)[:, [0, 1, 20, 21]])


def test_a_gguf_drafts_full_head_is_let_go_and_read_from_its_store_file(tmp_path, monkeypatch, config_dir):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = save_tiny_gguf(tmp_path / "d.gguf", "qwen2", seed=0)
    gen = offspec.load(str(path), str(path), draft_vocab="full", **LOAD)
    model = gen.engine.drafter.runner.model
    old = model.get_output_embeddings().qweight
    storage = old.untyped_storage().data_ptr()
    assert old.untyped_storage().nbytes() > old.nbytes  # the head is a view of the resident `other` payload
    before = model.model.norm.weight.clone()
    ids = torch.arange(0, 262, 3)
    rows = kernels.stored_rows(model.get_output_embeddings()).clone()  # row-major (a resident head is interleaved)
    assert restrict_head(model, ids, source=rows) is not None
    del old
    holders = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if not t.is_meta and t.untyped_storage().data_ptr() == storage]
    assert holders == []  # nothing keeps the payload: its pages go back
    assert torch.equal(model.model.norm.weight, before)
    assert head_rows(model).tolist() == ids.tolist()
    # loaded reduced, the draft admits tokens from its full head memory-mapped from the store's file
    write_table(config_dir, gen.tokenizer, range(262))
    reduced = offspec.load(str(path), str(path), draft_vocab=50, **LOAD)
    sub = reduced.engine.drafter.runner.model.get_output_embeddings()
    assert isinstance(sub, SubsetHead) and mapped_file(sub.source).endswith(".bin")
    assert torch.equal(sub.source, model.get_output_embeddings().source)  # the same rows as the resident head's


# --- lossless drafting ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return (save_tiny_gguf(root / "t.gguf", "qwen2", seed=0, layers=4),
            save_tiny_gguf(root / "d.gguf", "qwen2", seed=0, layers=4, noise=0.002))


def test_a_reduced_draft_proposes_only_its_tokens_and_the_output_is_the_targets(gguf_pair, tmp_path, monkeypatch,
                                                                            config_dir):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = map(str, gguf_pair)
    full = offspec.load(target, draft, draft_vocab="full", **LOAD)
    plain = full.generate("Hello there", max_new_tokens=40, speculate=False)
    # the ranks put the target's own reply tokens first, then every other token: 60 keeps some of them only
    counts = collections.Counter(plain.token_ids)
    ranked = [t for t, _ in counts.most_common()] + [t for t in range(262) if t not in counts]
    write_table(config_dir, full.tokenizer, ranked)  # the vocabulary as read from the GGUF
    gen = offspec.load(target, draft, draft_vocab=60, **LOAD)
    kept = set(gen.engine.drafter.runner.vocab_ids.tolist())
    assert gen.info.extra["draft_vocab"] == len(kept) and 60 <= len(kept) < 262
    assert set(full.tokenizer.all_special_ids) <= kept
    tokens = gen.encode("Hello there")
    tree = gen.engine.drafter.propose(tokens, gen.tree.__class__(budget=64, drafter="model"), 0.0)
    allowed = set(gen.engine.drafter.runner.vocab_ids.tolist())
    assert allowed == kept | set(tokens)  # the conversation's tokens were given rows
    assert set(tree.tokens[1 : tree.n].tolist()) <= allowed and tree.n > 32
    accepted = 0
    for budget in (1, 8, 64):
        result = gen.generate("Hello there", max_new_tokens=40, budget=budget, drafter="model")
        assert result.token_ids == plain.token_ids, budget
        accepted += sum(p.accepted for p in result.passes)
    assert accepted > 0
    few = offspec.load(target, draft, draft_vocab=3, **LOAD)  # most of the target's tokens cannot be drafted
    assert few.generate("Hello there", max_new_tokens=40, budget=8, drafter="model").token_ids == plain.token_ids


@pytest.mark.slow
def test_sampling_with_a_reduced_draft_follows_the_target_distribution(tiny_dirs, config_dir):
    """The first two sampled tokens against the target's exact distribution (chi-square), the draft's head cut to
    a quarter of the vocabulary."""
    write_table(config_dir, make_tokenizer(), range(261, -1, -1))
    gen = offspec.load(str(tiny_dirs[("llama", 0)][0]), str(tiny_dirs[("llama", 0)][1]), max_context=64,
                       draft_vocab=64)
    assert gen.info.extra["draft_vocab"] < 80
    sampling = SamplingConfig(temperature=1.5, top_k=3)
    prompt_ids = gen.encode(MESSAGES)
    exact = exact_two_token_distribution(gen, prompt_ids, sampling)
    n, counts, accepted = 1200, collections.Counter(), 0
    for seed in range(n):
        res = gen.generate(MESSAGES, max_new_tokens=2, temperature=1.5, top_k=3, seed=seed, budget=16,
                           drafter="model")
        counts[tuple(res.token_ids)] += 1
        accepted += sum(p.accepted for p in res.passes)
    assert set(counts) <= set(exact) and accepted > 0
    chi2, bins, p_value = chi_square(counts, exact, n)
    assert bins >= 4 and p_value > 0.001, (chi2, bins)


def test_a_float_draft_is_reduced_and_a_head_that_cannot_be_is_refused_or_kept(tiny_dirs, config_dir):
    write_table(config_dir, make_tokenizer(), range(262))
    target, draft = map(str, tiny_dirs[("qwen2", 0)])
    gen = offspec.load(target, draft, dtype="float64", draft_vocab=100, **LOAD)
    assert isinstance(gen.engine.drafter.runner.model.get_output_embeddings(), SubsetHead)
    plain = gen.generate("Hi", max_new_tokens=16, speculate=False)
    assert gen.generate("Hi", max_new_tokens=16, budget=16, drafter="model").token_ids == plain.token_ids

    # transformers' own assisted generation drives the draft's forward: full-vocabulary logits, -inf off the rows
    from offspec.cli.bench import parse_setups, run_bench

    report = run_bench(gen, ["Hi"], parse_setups("ar,hf", gen.tree), max_new_tokens=8, temperature=0.0,
                       out_dir=config_dir)
    assert report["setups"]["hf-assisted"]["tokens"] == 8 and report["environment"]["extra"]["draft_vocab"] < 120

    class Odd(torch.nn.Module):  # a head of another kind (bitsandbytes' on CUDA): nothing to gather
        out_features = 262

    model = gen.engine.target.model
    saved = model.get_output_embeddings()
    model.set_output_embeddings(Odd())
    try:
        assert reduce_draft_head(model, make_tokenizer(), "auto") is None
        with pytest.raises(OffspecError, match="--draft-vocab full"):
            reduce_draft_head(model, make_tokenizer(), 100)
    finally:
        model.set_output_embeddings(saved)


def test_the_placement_charges_a_reduced_heads_logits_and_the_fitted_prefill():
    from helpers.tiny import tiny_config

    from offspec.offload.estimates import DRAFT_LOGIT_ROWS, activation_bytes, draft_headroom, kv_cache_bytes

    cfg = tiny_config("qwen2", vocab_size=1000)
    slots = 256 + 2 * 17 + 64
    full = draft_headroom(cfg, 256, 16, 4)
    assert full == kv_cache_bytes(cfg, slots, 4) + activation_bytes(cfg, 256, slots, 4, DRAFT_LOGIT_ROWS)
    assert full - draft_headroom(cfg, 256, 16, 4, head_rows=100) == DRAFT_LOGIT_ROWS * 900 * 4
    assert draft_headroom(cfg, 256, 16, 4, prefill_tokens=128) == \
        kv_cache_bytes(cfg, slots, 4) + activation_bytes(cfg, 128, slots, 4, DRAFT_LOGIT_ROWS)


def test_the_shipped_table_of_the_default_pairs_tokenizer_is_found():
    """The Qwen2.5 table ships in offspec/data/token_ranks and is what `--draft-vocab auto` finds for its tokenizer
    (its fingerprint is the table's own; the default pair's tokenizer is checked by the integration tests)."""
    from offspec.models.draft_vocab import SHIPPED, find_ranks, read_ranks

    table = SHIPPED / "qwen2.5.json"
    assert table.is_file()
    found = find_ranks(read_ranks(table)["tokenizer"])
    assert found is not None and found[1] == table and len(found[0]) >= 65_536
