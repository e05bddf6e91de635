"""Tier 1: a draft of another vocabulary, mapped through text (offspec/spec/xvocab.py), scripted without a model.

The tokenizers are tests/helpers/tiny_vocab.py's: byte-level BPE with other merges and shuffled ids, and a
SentencePiece-style one built here.
"""

import math

import pytest
from helpers.tiny import make_tokenizer
from helpers.tiny_vocab import DRAFT_MERGES, TARGET_MERGES, merged_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from offspec.spec.token_text import TokenTexts, complete_utf8
from offspec.spec.xvocab import DraftContext, VocabMapping, map_tree


@pytest.fixture(scope="module")
def target_tok():
    return merged_tokenizer(TARGET_MERGES)  # "Ġthe", "Ġcat", "ll", "Ã©" (é) are single tokens


@pytest.fixture(scope="module")
def draft_tok():
    return merged_tokenizer(DRAFT_MERGES, seed=7)  # "ell" and "Ġthe" are; "Ġcat" is "Ġc" "a" "t"; ids shuffled


@pytest.fixture(scope="module")
def mapping(target_tok, draft_tok):
    return VocabMapping(target_tok, draft_tok)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-like tokenizer: "▁" for a space put before the text, raw bytes as <0xNN>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "▁c", "at", "▁cat", "é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("a", "t"), ("▁c", "at")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def ids_of(tok, *pieces):
    vocab = tok.get_vocab()
    return [vocab[p] for p in pieces]


def chain(mapping, draft_tok, root, pieces, step=-0.1):
    """A draft tree that is one path: (tokens, parents, scores) host lists."""
    tokens = [root] + ids_of(draft_tok, *pieces)
    return tokens, [-1] + list(range(len(pieces))), [0.0] + [step * (k + 1) for k in range(len(pieces))]


def target_paths(tree, target_tok):
    """Every root-to-node path of a mapped tree, as token pieces."""
    pieces = target_tok.convert_ids_to_tokens(tree.tokens)
    paths = []
    for k in range(len(tree.tokens)):
        path, at = [], k + 1
        while at > 0:
            path.append(pieces[at - 1])
            at = tree.parents[at - 1]
        paths.append(tuple(reversed(path)))
    return paths


# --- token texts --------------------------------------------------------------------------------------------------
def test_byte_level_token_texts_and_encoding(target_tok):
    texts = TokenTexts(target_tok)
    vocab = target_tok.get_vocab()
    assert texts.bytes[vocab["Ġthe"]] == b" the" and texts.bytes[vocab["Ã©"]] == "é".encode()
    assert texts.bytes[vocab["Ã"]] == b"\xc3"  # half of a character
    assert texts.bytes[vocab["<|user|>"]] == b"<|user|>" and vocab["<|user|>"] in texts.added
    assert not texts.prefix_space and not texts.adds_bos
    for text in [" the cat", "café<|user|>x", "\n\n  hello"]:
        ids = texts.encode_within([text])[0]
        assert ids == target_tok.encode(text, add_special_tokens=False) and texts.text(ids) == text.encode()
    assert texts.last_word(" the cat") == 4 and texts.last_word("cat") == 0


def test_sentencepiece_token_texts_and_encoding_in_the_middle_of_a_text():
    tok = sentencepiece_tokenizer()
    texts = TokenTexts(tok)
    vocab = tok.get_vocab()
    assert texts.bytes[vocab["▁the"]] == b" the" and texts.bytes[vocab["<0x0A>"]] == b"\n"
    assert texts.prefix_space  # its encoder puts a space before the text
    assert tok.encode("cat", add_special_tokens=False) == ids_of(tok, "▁cat")  # " cat", not "cat"
    cat, space_cat, x_the = texts.encode_within(["cat", " cat", "x the"])
    assert cat == ids_of(tok, "c", "at") and space_cat == ids_of(tok, "▁cat")
    assert texts.text(x_the) == b"x the"


def test_complete_utf8():
    e = "é".encode()
    assert complete_utf8(b"ab" + e) == 4 and complete_utf8(b"ab" + e[:1]) == 2
    assert complete_utf8("你".encode()[:2]) == 0 and complete_utf8(b"") == 0


# --- proposals: draft paths -> target tokens ------------------------------------------------------------------------
def test_one_draft_token_makes_several_target_tokens(mapping, draft_tok, target_tok):
    """The draft's "ell" is the target's "e" "ll": both come from that one draft node, with its score."""
    tokens, parents, scores = chain(mapping, draft_tok, 0, ["Ġ", "H", "ell", "o", "Ġthe"])
    tree = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=1.0)
    assert ("Ġ", "H", "e", "ll", "o", "Ġthe") in target_paths(tree, target_tok)
    pieces = target_tok.convert_ids_to_tokens(tree.tokens)
    e, ll = pieces.index("e"), pieces.index("ll")
    assert tree.parents[ll] == e + 1 and tree.scores[e] == tree.scores[ll] == pytest.approx(scores[3])


def test_several_draft_tokens_make_one_target_token(mapping, draft_tok, target_tok):
    """ "Ġc" "a" "t" (three draft tokens) are the target's one "Ġcat": proposed once the word is complete (" cat the"),
    and the partial words (" c", " ca") only as weaker candidates."""
    tokens, parents, scores = chain(mapping, draft_tok, 0, ["Ġc", "a", "t", "Ġthe", "Ġc"])
    tree = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.5)
    paths = target_paths(tree, target_tok)
    assert ("Ġcat", "Ġthe") in paths
    cat = paths.index(("Ġcat",))
    assert tree.scores[cat] == pytest.approx(scores[4])  # full weight from " cat the", where "Ġcat" is a whole word
    c = paths.index(("Ġc",))
    assert tree.scores[c] == pytest.approx(scores[1] + math.log(0.5))  # " c" could still grow into another word
    dropped = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.0)
    assert target_paths(dropped, target_tok) == [("Ġcat",), ("Ġcat", "Ġthe")]  # unfinished words dropped


def test_a_path_that_ends_inside_a_target_token(mapping, draft_tok, target_tok):
    """ " the c" ends inside the target's "Ġcat" (or "Ġc"...): its last word is weaker, or dropped."""
    tokens, parents, scores = chain(mapping, draft_tok, 0, ["Ġthe", "Ġc"])
    weak = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.5)
    assert target_paths(weak, target_tok) == [("Ġthe",), ("Ġthe", "Ġc")]
    assert weak.scores == pytest.approx([scores[2], scores[2] + math.log(0.5)])
    dropped = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.0)
    assert target_paths(dropped, target_tok) == [("Ġthe",)]


def test_utf8_split_across_draft_tokens_and_a_pending_character(mapping, draft_tok, target_tok):
    """é is two draft tokens (its two bytes) and one target token. A path ending after the first byte proposes
    nothing for it; a committed first byte (`pending`) must begin every path, and is not proposed again."""
    tokens, parents, scores = chain(mapping, draft_tok, 0, ["c", "a", "f", "Ã", "©", "Ġthe"])
    tree = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.0)
    assert ("c", "a", "f", "Ã©") in target_paths(tree, target_tok)
    assert all("Ã" not in p for p in target_paths(tree, target_tok))  # never the lone first byte
    # a byte-only target committed "Ã": the draft, whose context stops before that byte, proposes "Ã" "©" ...
    byte_target = make_tokenizer()
    mapped = VocabMapping(byte_target, draft_tok)
    tokens, parents, scores = chain(mapped, draft_tok, 0, ["Ã", "©", "Ġthe"])
    tree = map_tree(mapped, tokens, parents, scores, b"\xc3", budget=64, trailing=1.0)
    assert target_paths(tree, byte_target) == [("©",), ("©", "Ġ"), ("©", "Ġ", "t"), ("©", "Ġ", "t", "h"),
                                               ("©", "Ġ", "t", "h", "e")]  # after the committed byte
    other = chain(mapped, draft_tok, 0, ["Ġthe"])  # does not spell the pending byte's character: nothing
    assert map_tree(mapped, *other, b"\xc3", budget=64, trailing=1.0).tokens == []


def test_paths_merge_into_one_trie_within_the_budget(mapping, draft_tok, target_tok):
    """Two tokenizations of the same text are one target path, scored by the better; the budget keeps the best
    nodes, and they form a tree (parents first, scores never increasing along a path)."""
    # 0 -> "Ġthe" (1) -> "Ġc" (2) -> "at" ... ; 0 -> "Ġ" (3) -> "th" (4) -> "e" (5) -> "Ġc" (6); 0 -> "Ġc" (7) -> ...
    d = dict(zip(["Ġthe", "Ġc", "a", "t", "Ġ", "th", "e", "ell", "o"],
                 ids_of(draft_tok, "Ġthe", "Ġc", "a", "t", "Ġ", "th", "e", "ell", "o")))
    tokens = [0, d["Ġthe"], d["Ġc"], d["a"], d["t"], d["Ġ"], d["th"], d["e"], d["Ġc"], d["a"], d["t"], d["Ġc"],
              d["ell"], d["o"]]
    parents = [-1, 0, 1, 2, 3, 0, 5, 6, 7, 8, 9, 0, 11, 12]
    scores = [0.0, -0.2, -0.4, -0.5, -0.6, -1.0, -1.1, -1.2, -1.3, -1.4, -1.5, -2.0, -2.5, -3.0]
    tree = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.5)
    paths = target_paths(tree, target_tok)
    assert len(paths) == len(set(paths))  # one node per target prefix
    assert tree.scores[paths.index(("Ġthe",))] == pytest.approx(-0.4)  # the better of -0.4 and -1.3
    for k, p in enumerate(tree.parents):
        assert p <= k and (p == 0 or tree.scores[p - 1] >= tree.scores[k])
    small = map_tree(mapping, tokens, parents, scores, b"", budget=3, trailing=0.5)
    assert len(small.tokens) == 3
    best = sorted(tree.scores, reverse=True)[:3]
    assert sorted(small.scores, reverse=True) == pytest.approx(best)
    assert all(p <= k for k, p in enumerate(small.parents))


def test_special_tokens_across_vocabularies(target_tok, draft_tok):
    """An end of turn the target also has is proposed as the target's token; a special token it lacks ends the
    path; the draft's end of text stands for the target's."""
    other = merged_tokenizer(DRAFT_MERGES, seed=3)
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    mapping = VocabMapping(target_tok, other)
    tokens, parents, scores = chain(mapping, other, 0, ["Ġthe", "</s>", "<|tool|>", "Ġthe"])
    tree = map_tree(mapping, tokens, parents, scores, b"", budget=64, trailing=0.0)
    assert target_paths(tree, target_tok) == [("Ġthe",), ("Ġthe", "</s>")]  # whole: "</s>" cannot grow


# --- the draft's context ----------------------------------------------------------------------------------------
def test_draft_context_follows_the_committed_text_incrementally(mapping, target_tok, draft_tok):
    text = "<|user|>Hello the cat café, the cell</s><|assistant|>the cat"
    target_ids = target_tok.encode(text, add_special_tokens=False)
    context = DraftContext(mapping)
    previous = []
    for k in range(1, len(target_ids) + 1):
        kept = context.sync(target_ids[:k])
        assert context.ids[:kept] == previous[:kept]  # what it keeps is a prefix of what it had
        previous = list(context.ids)
        whole = mapping.context_text(target_ids[:k])
        assert bytes(context.spelled) + context.pending == whole
    assert context.ids == draft_tok.encode(text, add_special_tokens=False)  # the draft's own encoding in the end


def test_draft_context_moves_a_boundary_back_and_follows_a_new_conversation(mapping, target_tok, draft_tok):
    target = target_tok.get_vocab()
    context = DraftContext(mapping)
    context.sync(ids_of(target_tok, "Ġ", "H", "e"))
    assert draft_tok.convert_ids_to_tokens(context.ids) == ["Ġ", "H", "e"]
    kept = context.sync(ids_of(target_tok, "Ġ", "H", "e", "ll"))  # " Hell": the draft's "ell" replaces its "e"
    assert draft_tok.convert_ids_to_tokens(context.ids) == ["Ġ", "H", "ell"] and kept == 2
    kept = context.sync([target["Ġthe"]])  # another conversation: nothing in common
    assert kept == 0 and draft_tok.convert_ids_to_tokens(context.ids) == ["Ġthe"]
    # a committed first byte of a character waits for the rest
    byte_target = make_tokenizer()
    split = DraftContext(VocabMapping(byte_target, draft_tok))
    a, b = byte_target.encode("é", add_special_tokens=False)
    split.sync([a])
    assert split.ids == [] and split.pending == b"\xc3"
    split.sync([a, b])
    assert split.pending == b"" and draft_tok.convert_ids_to_tokens(split.ids) == ["Ã", "©"]


def test_draft_context_keeps_accepted_draft_tokens(mapping, target_tok, draft_tok):
    context = DraftContext(mapping)
    context.sync(target_tok.encode("<|user|>Hi", add_special_tokens=False))
    base = list(context.ids)
    context.append(ids_of(draft_tok, "Ġthe", "Ġc"))  # the target accepted " the c..." from the draft's tree
    kept = context.sync(target_tok.encode("<|user|>Hi the cat", add_special_tokens=False))
    assert context.ids[: len(base) + 1] == base + ids_of(draft_tok, "Ġthe")
    assert kept >= len(base) + 1
    assert context.ids == draft_tok.encode("<|user|>Hi the cat", add_special_tokens=False)
