"""The command line as a user runs it: `python main.py generate ...`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_generate_json_has_the_documented_fields(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    proc = run("generate", "--target", str(target), "--draft", str(draft), "--json", "--max-new-tokens", "16",
               "--budget", "8", "Hello there")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("text", "token_ids", "passes", "tokens_per_pass", "seconds", "tokens_per_second",
                "prefill_seconds", "decode_tokens_per_second"):
        assert key in out
    assert 0 < out["prefill_seconds"] < out["seconds"]
    assert out["decode_tokens_per_second"] > out["tokens_per_second"]  # the same tokens, without the prompt's time
    assert out["passes"] >= 1 and len(out["token_ids"]) <= 16
    assert abs(out["tokens_per_pass"] - len(out["token_ids"]) / out["passes"]) < 1e-3


@pytest.mark.slow
def test_generate_streams_text_and_no_speculate_matches(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    common = ["generate", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "12", "Hi"]
    spec, plain = run(*common), run(*common, "--no-speculate")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout
    assert "tokens/pass" in spec.stderr and "tokens/s; prompt " in spec.stderr and " s, then " in spec.stderr


@pytest.mark.slow
def test_bad_input_is_one_line_without_traceback(tiny_dirs):
    target, draft = tiny_dirs[("qwen2", 0)]
    cases = [
        ("generate", "--target", "/nonexistent/model", "hi"),
        ("generate", "--target", str(target), "--draft", str(draft), "--budget", "0", "hi"),
        ("generate", "--target", str(target), "--draft", str(draft), "--max-context", "8", "a long prompt, too long"),
    ]
    for args in cases:
        proc = run(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert len(lines) == 1, proc.stderr


@pytest.mark.slow
def test_generate_follows_a_json_schema_file_and_prints_log_probabilities(tiny_dirs, tmp_path):
    target, draft = tiny_dirs[("qwen2", 0)]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"],
                                  "additionalProperties": False}))
    common = ["generate", "--target", str(target), "--draft", str(draft), "--json", "--max-new-tokens", "20",
              "--budget", "8", "Hello"]
    proc = run(*common, "--json-schema", str(schema), "--logprobs", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert json.loads(out["text"])["k"] in ("v", "w") and out["stop_reason"] == "eos"
    assert len(out["logprobs"]) == len(out["token_ids"]) and len(out["logprobs"][0]["top"]) == 2
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    proc = run(*common, "--grammar", str(grammar))
    assert proc.returncode == 0 and json.loads(proc.stdout)["text"] in ("yes", "no"), proc.stderr
    for args, message in ((["--json-schema", str(tmp_path / "none.json")], "not found"),
                          (["--json-schema", str(grammar)], "not valid JSON"),
                          (["--logprobs", "30"], "logprobs must be"),
                          (["--json-schema", "object", "--grammar", str(grammar)], "not both")):
        proc = run(*common, *args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
