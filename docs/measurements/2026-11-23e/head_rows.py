import time, torch
import offspec
g = offspec.load(draft="none")
r = g.engine.target
print(type(r.lm_head).__name__, r.head_is_row_invariant)
h = torch.randn(16, 1536)
for n in [1, 2, 4, 8]:
    r.logits(h[:n])
    ts = []
    for _ in range(15):
        t0 = time.perf_counter(); r.logits(h[:n]); ts.append(time.perf_counter() - t0)
    ts.sort(); print('head rows', n, f'min {ts[0]*1e3:.1f} med {ts[7]*1e3:.1f} ms', flush=True)
