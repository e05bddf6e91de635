"""llama-bench's `tg N` on offspec: N random token ids decoded one pass at a time through the target alone, fed as
llama-bench feeds them (teacher-forced: the next id is random, not the model's), after a warm-up of 4. Prints one
JSON line: tokens/s, and for a mixture the expert cache's reads and hits over the timed passes and the expert-use
distribution (a twin's routing is not a real model's: report it beside the figure).

    python scripts/decode_bench.py MODEL.gguf [--n 32] [--device-mem 5.2GB --offload-dir DIR] [--seed 0]

Run it alternating with `llama-bench -m MODEL.gguf -p 0 -n N -t 2` on a quiet machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--n", type=int, default=32, help="timed tokens (llama-bench's tg N)")
    parser.add_argument("--device-mem", help="offspec's memory budget (default: resident)")
    parser.add_argument("--offload-dir", help="where a streamed target's weights go (with --device-mem)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import offspec
    from offspec.formats.experts import expert_use

    options = {"device_mem": args.device_mem, "offload_dir": args.offload_dir} if args.device_mem else {}
    try:
        gen = offspec.load(args.model, "none", budget=4, max_context=512, max_budget=16, **options)
    except offspec.OffspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runner = gen.engine.target
    rng = random.Random(args.seed)
    ids = [rng.randrange(runner.model.config.vocab_size) for _ in range(args.n + 4)]
    runner.cache.truncate(0)

    def step(i: int) -> None:
        hidden = runner.forward(torch.tensor([ids[i]]), torch.tensor([i]), torch.tensor([i]),
                                torch.ones((1, i + 1), dtype=torch.bool))  # (1, hidden)
        int(runner.logits(hidden).argmax())  # the token choice a decoding step ends with (a CPU sync)

    cache = runner.io if hasattr(runner.io, "stats") else None
    for i in range(4):
        step(i)
    before = cache.stats() if cache is not None else {}
    start = time.perf_counter()
    for i in range(4, args.n + 4):
        step(i)
    seconds = time.perf_counter() - start
    out: dict = {"model": Path(args.model).name, "n": args.n, "tokens_per_second": round(args.n / seconds, 3)}
    if cache is not None:
        after = cache.stats()
        asked = after["experts_asked"] - before["experts_asked"]
        hits = after["expert_hits"] - before["expert_hits"]
        out.update(experts_per_token=asked / args.n, read_per_token=(asked - hits) / args.n,
                   hit_rate=hits / asked if asked else None,
                   mb_read_per_token=(after["expert_read_bytes"] - before["expert_read_bytes"]) / args.n / 1e6,
                   prefetch_accuracy=after["prefetch_accuracy"])
    use = expert_use(runner.model)
    if use is not None:
        out["expert_use"] = {k: use[k] for k in ("used", "experts", "hot_50", "hot_90", "hot_90_bytes", "hot_99")}
    print(json.dumps(out))
    gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
