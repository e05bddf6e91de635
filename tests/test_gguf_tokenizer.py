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
  5.17.0: `python -m venv V --system-site-packages; V/bin/pip install transformers==5.17.0`), the same ids.
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
