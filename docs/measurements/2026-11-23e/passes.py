import time, torch, sys
import offspec
from offspec.profile.timing import PassTimer
g = offspec.load(draft="none")
r = g.engine.target
ids = torch.arange(1000, 1060); pos = torch.arange(60)
r.forward(ids, pos, pos, torch.ones(60, 60, dtype=torch.bool).tril()); r.cache.length = 60
for n in [1, 2, 4, 8, 16, 32]:
    PassTimer._pass(r, n)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); PassTimer._pass(r, n); ts.append(time.perf_counter() - t0)
    ts.sort(); print(offspec.__file__.split('/')[2], 'pass', n, f'min {ts[0]*1e3:.0f} med {ts[3]*1e3:.0f} ms', flush=True)
