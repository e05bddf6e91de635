# Paired streamed runs: for each prompt, `offspec bench` of the base commit (a worktree of 9c15c6e in /tmp/base)
# and of this change, back to back, so the slow spells of this VM's disk hit both alike.
# (The "draft-vocab+extras" runs in runs.json came from a variant that added suffix candidates on top of the hybrid
# budget, behind a switch since removed: it was no faster, see the README beside this folder.)
#   bash paired.sh code offspec/data/code_edits.jsonl 10;  bash paired.sh mt ../shared/data/mt_bench_questions.jsonl 10
w=$1; file=$(realpath "$2"); n=$3; out=${OUT:-/tmp/pair}; mkdir -p "$out"
for i in $(seq 0 $((n - 1))); do
  sed -n "$((i + 1))p" "$file" > "$out/$w.$i.jsonl"
  for dir in /tmp/base "$(git rev-parse --show-toplevel)"; do
    v=$([ "$dir" = /tmp/base ] && echo base || echo new)
    (cd "$dir" && python main.py bench --device-mem 1GB --prompts "$out/$w.$i.jsonl" --n 1 --max-new-tokens 128 \
       --budgets hybrid:auto --out "$out/$w-$v-$i" > "$out/$w-$v-$i.log" 2>&1)
  done
done
