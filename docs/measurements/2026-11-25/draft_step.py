"""Draft step time (body + LM head) of the default pair's draft for nodes 1, 8, 32, with the whole head and
reduced heads (--draft-vocab), min/median of 30 calls, 2 threads. Usage: python draft_step.py"""
import statistics
import time

import torch

import offspec
from offspec.models.draft_vocab import choose_ids, restrict_head

gen = offspec.load(draft_vocab="full", budget=4)
runner = gen.engine.drafter.runner
model = runner.model
prompt = gen.encode("Write a Python function that merges two sorted lists, then explain it.")
runner.cache.truncate(0)
runner.extend(prompt)
n0 = len(prompt)


def step(k: int):
    slots = torch.arange(n0, n0 + k)
    visible = torch.ones((k, n0 + k), dtype=torch.bool)
    t0 = time.perf_counter()
    hidden = runner.forward(torch.full((k,), 1000), torch.full((k,), n0), slots, visible)
    t1 = time.perf_counter()
    logits = runner.logits(hidden)
    torch.topk(logits, 8, dim=-1)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


full_head = model.get_output_embeddings()
for vocab in ("full", 65536, 32768, 16384):
    if vocab != "full":
        model.set_output_embeddings(full_head)
        restrict_head(model, choose_ids(gen.tokenizer, vocab, 151936))
    runner.__init__(model, runner.capacity)  # the runner takes the head it finds
    runner.extend(prompt)
    for k in (1, 8, 32):
        for _ in range(3):
            step(k)
        body, head = zip(*(step(k) for _ in range(30)))
        print(f"vocab {vocab!s:>6} nodes {k:2d}: body {1000 * min(body):6.2f} / {1000 * statistics.median(body):6.2f} ms"
              f"  head {1000 * min(head):6.2f} / {1000 * statistics.median(head):6.2f} ms", flush=True)
