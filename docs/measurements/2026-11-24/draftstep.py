import time, torch, statistics
import offspec
from offspec.profile.timing import PassTimer
from offspec.spec.sampling import draft_logprobs
g = offspec.load()
e = g.engine
d = e.drafter.runner; t = e.target
for r in (t, d):
    ids = torch.arange(1000, 1060); pos = torch.arange(60)
    r.forward(ids, pos, pos, torch.ones(60, 60, dtype=torch.bool).tril()); r.cache.length = 60
timer = PassTimer(t, d, 8)
def med(fn, n=9):
    fn(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for k in (1, 4, 8, 16):
    h = PassTimer._pass(d, k)
    print(f"draft k={k}: step {med(lambda: timer.draft_step(k)):.1f} ms, body {med(lambda: PassTimer._pass(d, k)):.1f}, "
          f"head {med(lambda: d.logits(h)):.1f}, logprobs+topk {med(lambda: torch.topk(draft_logprobs(d.logits(h), 0.0), 8, dim=-1)) - med(lambda: d.logits(h)):.1f}")
print(f"target 1: {med(lambda: PassTimer._pass(t, 1)):.1f} ms, head {timer.head()*1e3:.1f}")
