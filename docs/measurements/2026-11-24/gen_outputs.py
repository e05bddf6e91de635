import json, sys, offspec
g = offspec.load(draft="none")
out = []
for line in open('offspec/data/code_edits.jsonl'):
    p = json.loads(line)["prompt"]
    ids = g.encode(p)
    r = g.generate(p, max_new_tokens=int(sys.argv[2]))
    out.append({"prompt_ids": ids, "output_ids": list(r.token_ids), "passes": len(r.passes)})
    print(len(out), len(r.token_ids), r.passes, flush=True)
json.dump(out, open(sys.argv[1], "w"))
