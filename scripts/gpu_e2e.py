"""What a user feels on one CUDA GPU, for scripts/gpu_check.py (issue 39): offspec end to end on the default pair's
shape twins (scripts/gpu/twin_gguf.py: the real headers, random blocks), against transformers' own generate() on
the same shapes in the same run, and the `pytest -m cuda` failures.

- `bench_command` / `bench_keys`: `offspec bench --budgets ar,16,64,256,1024` on the twins, resident:
  `e2e_ar_tok_s` (the target alone), `e2e_tree64_pass_vs_ar_pass` (a 64-node tree's target pass over a one-token
  pass), `e2e_greedy_mismatches` (tree set-up runs whose tokens are not ar's: random weights make near-ties
  everywhere, so only bit-exact kernels give 0);
- `offload_command` / `streamed_vs_link`: `offspec bench offload` with the target streamed from pinned RAM, 1 to
  64 tokens: the worst pass over its link time (`e2e_streamed_pass_vs_link`);
- `peer_tok_s`: transformers' generate() of the target's shapes, random bfloat16 weights made on the GPU itself
  (made on the CPU they took over a minute), greedy, 128 new tokens after 200 (the second of two runs);
- `pytest_failures`: failures and errors of the `pytest -m cuda` runs, from their junit files.

The parsing is plain Python, tested on a CPU (tests/test_gpu_check.py); the rest needs the GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TREE_BUDGETS = (16, 64, 256, 1024)
STREAMED_TOKENS = (1, 16, 64)


class SectionError(RuntimeError):
    """A section's failure, said in one line (its command's last output line, or the exception's first)."""


def one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]


def run(cmd: list[str], timeout: float, log: Path, check: bool = True) -> int:
    """Run `cmd` from the repository root, its output into `log`; its exit status (`check`: SectionError, in one
    line, unless 0)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        raise SectionError(f"{' '.join(cmd[2:4])}: stopped after {timeout:.0f} s") from None
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if check and proc.returncode != 0:
        raise SectionError(f"{' '.join(cmd[2:4])} exited {proc.returncode}: {one_line(proc.stderr or proc.stdout)}")
    return proc.returncode


def read_json(path: Path, log: Path) -> dict:
    """A command's JSON report (SectionError with the command's last line where it wrote none)."""
    import json

    if not path.is_file():
        raise SectionError(f"no {path.name}: {one_line(log.read_text()) if log.is_file() else 'the command never ran'}")
    return json.loads(path.read_text())


def pytest_failures(junits: list[Path]) -> int:
    """Failures plus errors over the junit files of the `pytest -m cuda` runs (SectionError: a run left none)."""
    total = 0
    for junit in junits:
        if not junit.is_file():
            raise SectionError(f"no {junit.name}: its pytest run did not finish")
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            total += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return total


def bench_command(twins: Path, out: Path, max_new_tokens: int = 32) -> list[str]:
    budgets = ",".join(["ar"] + [str(b) for b in TREE_BUDGETS])
    return [sys.executable, "main.py", "bench", "--target", str(twins / "t.gguf"), "--draft", str(twins / "d.gguf"),
            "--prompts", "offspec/data/code_edits.jsonl", "--n", "1", "--max-new-tokens", str(max_new_tokens),
            "--budgets", budgets, "--budget", "64", "--max-context", "2048", "--out", str(out)]


def bench_keys(report: dict) -> dict:
    """The e2e keys of a bench.json of `bench_command`'s set-ups."""
    setups = report["setups"]
    ar = setups["ar"]
    trees = [setups[str(b)] for b in TREE_BUDGETS if str(b) in setups]
    if len(trees) != len(TREE_BUDGETS) or any("greedy_mismatches" not in s for s in trees):
        raise SectionError(f"bench.json lacks tree set-ups or their check against ar: {sorted(setups)}")
    return {"e2e_ar_tok_s": round(ar["tokens_per_second"], 2),
            "e2e_tree64_pass_vs_ar_pass": round(setups["64"]["target_seconds_per_pass"] /
                                                ar["target_seconds_per_pass"], 3),
            "e2e_greedy_mismatches": sum(int(s["greedy_mismatches"]) for s in trees)}


def min_device_mem(target: Path, draft: str = "none") -> str:
    """The smallest --device-mem the placement accepts for `target` (its layers then stream): the size its
    refusal of 1 KB names."""
    import offspec

    try:
        offspec.load(str(target), draft, device="cuda", device_mem="1KB", max_context=2048, max_budget=64)
    except offspec.OffspecError as exc:
        found = re.search(r"--device-mem (\S+)", str(exc))
        if found:
            return found[1]
        raise SectionError(f"no --device-mem in the refusal: {one_line(str(exc))}") from None
    raise SectionError("1 KB of device memory was accepted")


def offload_command(target: Path, device_mem: str, out: Path) -> list[str]:
    return [sys.executable, "main.py", "bench", "offload", "--target", str(target), "--device-mem", device_mem,
            "--tokens", ",".join(map(str, STREAMED_TOKENS)), "--no-accelerate", "--repeat", "3", "--out", str(out)]


def streamed_vs_link(report: dict) -> float:
    """The worst streamed pass of up to 64 tokens over its link time (bytes per pass / pinned bandwidth)."""
    bound = report.get("stream_bound_seconds")
    if not bound:
        raise SectionError(f"nothing streamed ({report.get('placement', {}).get('layers')})")
    worst = max(row["seconds"] for row in report["offspec"] if row["tokens"] <= max(STREAMED_TOKENS))
    return round(worst / bound, 3)


def peer_model(device, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int):
    """transformers' Qwen2 of these shapes, random bfloat16 weights made on `device` itself."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=True, max_position_embeddings=32768)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def peer_tok_s(model, prompt_tokens: int = 200, new_tokens: int = 128, runs: int = 2) -> float:
    """generate()'s tokens per second, greedy, `new_tokens` after a random prompt (prefill included), the last of
    `runs` runs."""
    import torch

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), device=device)  # (1, prompt)
    rate = 0.0
    with torch.no_grad():
        for _ in range(runs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # sync: time the whole generation
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rate = (out.shape[1] - prompt_tokens) / (time.perf_counter() - t0)
    return round(rate, 2)


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return round(numerator / denominator, 3) if numerator and denominator else None
