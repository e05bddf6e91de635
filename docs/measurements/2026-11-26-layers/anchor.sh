#!/usr/bin/env bash
# The target alone, 128 tokens of the first MT-Bench question: offspec with compiled layers, offspec with
# transformers' layers (OFFSPEC_LAYERS=transformers) and llama.cpp's tg128 (the CPU peer), alternating, 3 rounds.
#   bash docs/measurements/2026-11-26-layers/anchor.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
GGUF=~/.cache/offspec/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
Q1=$(head -1 ../shared/data/mt_bench_questions.jsonl | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['turns'][0])")
summary='import json,sys; d=json.load(sys.stdin); p=d["per_pass"][1:]; t=sum(x["target_seconds"] for x in p); print("%.2f tok/s with the prefill, %.2f passes alone" % (d["tokens_per_second"], len(p)/t))'
for round in 1 2 3; do
  for layers in auto transformers; do
    printf 'round %s offspec layers=%s: ' "$round" "$layers"
    OFFSPEC_LAYERS=$layers python3 main.py generate --no-speculate --max-new-tokens 128 --json "$Q1" 2>/dev/null | python3 -c "$summary"
  done
  printf 'round %s llama.cpp: ' "$round"
  bash ../shared/anchors/llamacpp.sh ar "$GGUF" 2>/dev/null | grep tg128 | tr -s ' '
done
