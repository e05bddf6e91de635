#!/bin/bash
cd /work/main
T=$(ls ~/.cache/offspec/gguf/*.gguf | grep -i 1.5b | head -1); D=$(ls ~/.cache/offspec/gguf/*.gguf | grep -i 0.5b | head -1)
echo "T=$T D=$D"
O=/tmp/m/final; mkdir -p $O
date > $O/llama.txt
echo "# AMX build ar" >> $O/llama.txt
bash ../shared/anchors/llamacpp.sh ar "$T" >> $O/llama.txt 2>&1
echo "# no-AMX build ar" >> $O/llama.txt
LLAMACPP_HOME=/tmp/llama-noamx bash ../shared/anchors/llamacpp.sh ar "$T" >> $O/llama.txt 2>&1
echo "# no-AMX build spec, 20 code edits" >> $O/llama.txt
LLAMACPP_HOME=/tmp/llama-noamx bash ../shared/anchors/llamacpp.sh spec "$T" "$D" offspec/data/code_edits.jsonl 20 >> $O/llama.txt 2>&1
date >> $O/llama.txt
python main.py bench --prompts offspec/data/code_edits.jsonl --n 20 --max-new-tokens 128 \
    --budgets ar,model:auto,suffix:auto,hybrid:auto --session --out $O/code-sess > $O/code-sess.log 2>&1
date >> $O/llama.txt
echo "# AMX build ar, after" >> $O/llama.txt
bash ../shared/anchors/llamacpp.sh ar "$T" >> $O/llama.txt 2>&1
echo done >> $O/llama.txt
