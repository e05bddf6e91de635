"""A GGUF target alone, offspec against llama.cpp on the same file: decode and prefill, alternating rounds.

    python scripts/quant_bench.py FILE.gguf [FILE.gguf ...] [--rounds 2] [--threads 2]

offspec: `offspec generate --target FILE --draft none --no-speculate --max-new-tokens 128 --json "<MT-Bench
question 81>"` (its decode_tokens_per_second: new tokens after the prefill), then the same with --max-new-tokens 1 on
a prompt of about 512 tokens (MT-Bench questions run together; prefill tokens over prefill seconds). llama.cpp:
`llama-bench -m FILE -p 512 -n 128 -t THREADS -r 2` from ../shared/anchors/llamacpp.sh's build (LLAMACPP_HOME).
Prints one markdown row per file: the ranges over the rounds and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"
LLAMA = Path(os.environ.get("LLAMACPP_HOME", Path.home() / ".cache/offspec-anchors/llama.cpp")) / "build" / "bin"


def questions() -> list[str]:
    return [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines() if line.strip()]


def offspec(target: str, prompt: str, new_tokens: int, threads: int) -> dict:
    cmd = [sys.executable, str(ROOT / "main.py"), "generate", "--target", target, "--draft", "none",
           "--no-speculate", "--max-new-tokens", str(new_tokens), "--json", prompt]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_bench(target: str, threads: int) -> tuple[float, float]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA))
    out = subprocess.run([str(LLAMA / "llama-bench"), "-m", target, "-p", "512", "-n", "128", "-t", str(threads),
                          "-r", "2", "-o", "json"], capture_output=True, text=True, env=env, check=True).stdout
    rates = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in json.loads(out)}
    return rates["tg"], rates["pp"]


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    qs = questions()
    short = qs[80] if len(qs) > 80 else qs[0]
    long_prompt = "\n\n".join(qs[:11])  # about 512 tokens with the chat template
    print("| file | offspec decode | llama.cpp tg128 | ratio | offspec prefill (tokens) | llama.cpp pp512 | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for target in args.files:
        dec, pre, tg, pp, prompt_tokens = [], [], [], [], 0
        for _ in range(args.rounds):
            dec.append(offspec(target, short, 128, args.threads)["decode_tokens_per_second"])
            run = offspec(target, long_prompt, 1, args.threads)
            prompt_tokens = run["prompt_tokens"]
            pre.append((prompt_tokens - 1) / run["prefill_seconds"])
            t, p = llama_bench(target, args.threads)
            tg.append(t)
            pp.append(p)
        ratio = statistics.median(dec) / statistics.median(tg)
        pratio = statistics.median(pre) / statistics.median(pp)
        print(f"| {Path(target).name} | {span(dec)} | {span(tg)} | {ratio:.2f}x | {span(pre)} ({prompt_tokens}) | "
              f"{span(pp)} | {pratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
