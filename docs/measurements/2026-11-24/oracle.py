import json, sys
data = json.load(open(sys.argv[1]))
def longest_copy(ctx, out, k, maxlen=64):
    # longest L such that out[k:k+L] occurs in ctx (ctx includes out[:k])
    best = 0
    s = ctx
    n = len(s)
    for i in range(n):
        L = 0
        while L < maxlen and k + L < len(out) and i + L < n and s[i+L] == out[k+L]:
            L += 1
        best = max(best, L)
    return best
tot_tok = tot_pass = 0
for ex in data:
    p, out = ex["prompt_ids"], ex["output_ids"][:128]
    k = 0
    while k < len(out):
        L = longest_copy(p + out[:k], out, k)
        k += L + 1; tot_pass += 1; tot_tok += L + 1
print("oracle copy tokens/pass", tot_tok / tot_pass)
base, per = 0.028, 0.0051
for minL in (1, 2, 3, 4, 6):
    t = 0; tok = 0
    for ex in data:
        p, out = ex["prompt_ids"], ex["output_ids"][:128]
        k = 0
        while k < len(out):
            L = longest_copy(p + out[:k], out, k)
            if L < minL: L = 0
            t += base + L * per; k += L + 1; tok += L + 1
    print(f"oracle chain (only when L>={minL}) speed-up {tok*base/t:.2f}x")
