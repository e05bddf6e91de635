#!/bin/bash
# One sitting: llama.cpp tg128 (the anchor's build), llama.cpp llama-speculative on the 20 code edits (a build
# without AMX: the anchor's crashes there on AMX CPUs, see ../2026-11-25-amx), offspec bench on the same 20 code
# edits (cold: no session history), llama.cpp tg128 again.
set -u
cd "$(dirname "$0")/../../.."
T=$(ls ~/.cache/offspec/gguf/*.gguf | grep -i 1.5b | head -1); D=$(ls ~/.cache/offspec/gguf/*.gguf | grep -i 0.5b | head -1)
O=docs/measurements/2026-11-25-kw; L=$O/llama.txt
date > $L
echo "# tg128 (anchor build), before" >> $L
bash ../shared/anchors/llamacpp.sh ar "$T" >> $L 2>&1
echo "# llama-speculative (no-AMX build), 20 code edits" >> $L
LLAMACPP_HOME=/tmp/llama-noamx bash ../shared/anchors/llamacpp.sh spec "$T" "$D" offspec/data/code_edits.jsonl 20 >> $L 2>&1
date >> $L
python main.py bench --prompts offspec/data/code_edits.jsonl --n 20 --max-new-tokens 128 \
    --budgets ar,model:auto,suffix:auto,hybrid:auto --out $O/code-cold > $O/code-cold.log 2>&1
date >> $L
echo "# tg128 (anchor build), after" >> $L
bash ../shared/anchors/llamacpp.sh ar "$T" >> $L 2>&1
echo done >> $L
