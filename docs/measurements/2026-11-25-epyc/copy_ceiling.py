"""Copy drafting ceilings on a bench run's outputs (greedy target tokens), per prompt and total.

    python docs/measurements/2026-11-25-epyc/copy_ceiling.py BENCH_JSON SETUP [show]

(the prompts: offspec/data/code_edits.jsonl; the tokenizer: the default target's GGUF under offspec's cache)
  suffix1: the most recent occurrence of the longest matching suffix, its continuation (one chain)
  suffixB: the best occurrence of the longest match (a tree over occurrences, oracle choice)
  resync:  suffixB plus, after a copy broke, the source resumed d = 0..3 tokens further (edit re-alignment)
  any:     the longest run of the next tokens found anywhere in prompt + output so far (the ceiling of any copy)
Tokens per pass = accepted + 1 (the target's own token)."""
import json, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from offspec.util.paths import cache_dir
from offspec.spec.suffix_index import SuffixIndex
from offspec.util.prompts import read_prompts
from transformers import AutoTokenizer
import glob
bench = json.load(open(sys.argv[1])); setup = sys.argv[2]
runs = bench["setups"][setup]["runs"]
prompts = read_prompts(ROOT / "offspec/data/code_edits.jsonl")
gg = sorted(glob.glob(f"{cache_dir()}/**/*1.5b*.gguf", recursive=True))
import os
tok = AutoTokenizer.from_pretrained(os.path.dirname(gg[0]), gguf_file=os.path.basename(gg[0]))
def enc(p):
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
def run_len(seq, j, out, i):
    k = 0
    while i + k < len(out) and j + k < len(seq) and seq[j + k] == out[i + k]:
        k += 1
    return k
tot = {"n": 0, "s1": 0, "sB": 0, "rs": 0, "any": 0}
show = len(sys.argv) > 3
for r in runs:
    p = enc(prompts[r["prompt"]]); out = r["token_ids"]; seq = p + out
    res = {}
    for mode in ("s1", "sB", "rs"):
        idx = SuffixIndex(4); i = 0; passes = 0; follow = None  # follow: source position the last copy reached
        marks = []
        while i < len(out):
            ctx = seq[: len(p) + i]; idx.extend(ctx[idx.end:])
            m = idx.longest_match(ctx, 32, 256)
            cands = []
            if m.length:
                cands = [m.positions[-1]] if mode == "s1" else list(m.positions)
            if mode == "rs" and follow is not None:
                cands += [follow + d for d in range(0, 4) if follow + d < len(p) + i]
            best, bj = 0, None
            for j in cands:
                L = run_len(seq, j, out, i)
                if L > best: best, bj = L, j
            if mode == "rs":
                if bj is not None and best > 0: follow = bj + best + 1  # past the source token the target replaced
                elif follow is not None: follow += 1
            marks.append(best)
            i += best + 1; passes += 1
        res[mode] = passes
        if show and mode == "rs" and r["prompt"] < 3:
            i = 0; s = []
            for b in marks:
                s.append(tok.decode(out[i:i + b + 1]).replace("\n", "\\n")); i += b + 1
            print("|".join(s))
    i = passes = 0
    while i < len(out):
        ctx = seq[: len(p) + i]
        i += max([run_len(seq, j, out, i) for j in range(len(ctx)) if ctx[j] == out[i]] + [0]) + 1; passes += 1
    res["any"] = passes
    tot["n"] += len(out)
    for k in ("s1", "sB", "rs", "any"):
        tot[k] += res[k]
    print(r["prompt"], len(out), " ".join(f"{k} {len(out)/v:.2f}" for k, v in res.items()))
print("total", " ".join(f"{k} {tot['n']/tot[k]:.2f}" for k in ("s1", "sB", "rs", "any")))
