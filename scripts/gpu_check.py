"""The measurements of scripts/gpu_check.sh on one CUDA GPU: a kernel table, the 70B slice's Q4_K linears, a pass
sweep and a draft-step sweep on shape twins (scripts/gpu_twins.py), the target twin alone, the projection of a
70B Q4_K_M on an RTX 4090, and what a user feels end to end (scripts/gpu_e2e.py: offspec bench on the default
pair's GGUF twins resident and streamed, transformers' generate() on the same shapes, `pytest -m cuda`'s
failures). Writes OUT/gpu-check.md and OUT/gpu-check.json (the keys of issues 33 and 39).

    python scripts/gpu_check.py --out DIR [--work DIR] [--junit cuda.xml ...] [--twins DIR] [--deadline S] [--warm]

`--warm` runs every kernel section once at its smallest size, timing nothing: Triton compiles its kernels into its
cache, so that the timed run that follows (and the tests run beside it) find them compiled. Every section is
guarded: a failure leaves its keys null and its error in one line (the JSON's `errors`, the report; the traceback
only in OUT/gpu-check-errors.log); sections past the deadline are skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e  # noqa: E402
from gpu_twins import SHAPES, Stack, StreamedSlice, free_cuda, random_weight, time_ms  # noqa: E402

from offspec.formats.ggml import ggml_type  # noqa: E402
from offspec.formats.gpu.graphs import Graphs, run_bucketed  # noqa: E402
from offspec.formats.gpu.linear import linear  # noqa: E402

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4")
ROWS = (1, 4, 16, 64, 256, 1024)
WARM_ROWS = (1, 64, 256)  # one of each tiling: 16 rows, 64 with the K splits as programs, 64 with them in programs
KEYS = ("device", "q4k_1row_bandwidth_fraction", "q4k_64row_vs_bf16", "draft_step_ms", "slice_pass_vs_link",
        "slice_1024_vs_1", "target_alone_tok_s", "lossless_bf16", "projection_4090_70b_tok_s",
        "pytest_cuda_failed", "e2e_ar_tok_s", "e2e_vs_transformers", "e2e_tree64_pass_vs_ar_pass",
        "e2e_streamed_pass_vs_link", "e2e_greedy_mismatches")


class Report:
    def __init__(self, deadline: float, warm: bool, trace_log: Path | None = None):
        self.deadline, self.warm, self.trace_log = deadline, warm, trace_log
        self.values = {k: None for k in KEYS}
        self.errors: dict[str, str] = {}  # section title -> its failure, one line
        self.sections: list[tuple[str, str]] = []  # (title, markdown)

    def section(self, title: str, fn, *args) -> None:
        if time.monotonic() > self.deadline:
            self.sections.append((title, "skipped: the time budget was spent before it"))
            self.errors[title] = "skipped: the time budget was spent before it"
            print(f"[gpu_check] {title}: skipped (deadline)", flush=True)
            return
        t0 = time.monotonic()
        try:
            body = fn(self, *args)
        except Exception as exc:  # noqa: BLE001 - every section's failure is one line, and the others still run
            line = gpu_e2e.one_line(str(exc).splitlines()[0] if str(exc).strip() else "")
            self.errors[title] = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
            body = f"failed: {self.errors[title]}"
            if self.trace_log is not None:
                with self.trace_log.open("a") as log:
                    log.write(f"== {title}\n{traceback.format_exc()}\n")
        self.sections.append((title, f"{body}\n\n({time.monotonic() - t0:.0f} s)"))
        print(f"[gpu_check] {title}: {time.monotonic() - t0:.0f} s"
              + (f" - {self.errors[title]}" if title in self.errors else ""), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def json(self) -> dict:
        return dict(self.values, errors=self.errors)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment(r: Report, device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    n = (256 if r.warm else 2048) * 2**20
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    r.hbm = 2 * n / (time_ms(lambda: dst.copy_(src), device) / 1e3)  # bytes read + written per second
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    r.bf16_flops = 2 * 8192**3 / (time_ms(lambda: a @ a, device) / 1e3)
    from offspec.profile.hardware import host_to_device

    r.pinned, _ = host_to_device(device, 256 * 2**20)
    free_cuda(src, dst, a)
    r.values["device"] = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    return _table(["device", "memory bandwidth (copy)", "bf16 cuBLAS 8192^3", "pinned host->device"],
                  [[r.values["device"], f"{r.hbm / 1e9:.0f} GB/s", f"{r.bf16_flops / 1e12:.0f} TFLOP/s",
                    f"{r.pinned / 1e9:.1f} GB/s"]])


def _linear_times(device, type_name: str, n: int, k: int, rows: tuple, copies: int = 4):
    """{M: (ours ms, cuBLAS bf16 ms)} for an (n, k) weight of `type_name`, `copies` weights rotated (bigger than
    the L2 cache together)."""
    gen = torch.Generator(device=device).manual_seed(0)
    tid = ggml_type(type_name).id
    ws = [random_weight(type_name, n, k, device, gen) for _ in range(copies)]
    dense = [torch.randn((n, k), device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    out = {}
    for m in rows:
        x = torch.randn((m, k), device=device, dtype=torch.bfloat16, generator=gen)
        turn = iter(range(10**9))
        ours = time_ms(lambda: linear(x, [(ws[next(turn) % copies], tid)], k), device, repeats=12)
        cublas = time_ms(lambda: x @ dense[next(turn) % 2].T, device, repeats=12)
        out[m] = (ours, cublas)
    return out


def kernel_table(r: Report, device: torch.device) -> str:
    n, k = (64 if r.warm else 8192), 8192  # warm: the same K (Triton specializes on its divisibility), few rows
    rows = []
    for name in TYPES:
        times = _linear_times(device, name, n, k, WARM_ROWS if r.warm else ROWS, copies=1 if r.warm else 4)
        nbytes = n * ggml_type(name).row_bytes(k)
        for m, (ours, cublas) in times.items():
            rows.append([name, m, f"{ours:.3f}", f"{cublas:.3f}", f"{ours / cublas:.2f}",
                         f"{nbytes / (ours / 1e3) / r.hbm:.0%}" if m <= 16 else ""])
    return (f"Weights of {n} x {k}; milliseconds (median of 12, 4 weights rotated); the fraction of the copy "
            f"bandwidth a weight read reaches at up to 16 rows.\n\n" +
            _table(["type", "rows", "offspec ms", "cuBLAS bf16 ms", "ratio", "of bandwidth"], rows))


def q4k_slice(r: Report, device: torch.device) -> str:
    shape = SHAPES["70b"]
    rows, q4k_bytes, q4k_ms, worst = [], 0, 0.0, 0.0
    for name, n, k in shape.linears():
        type_name = shape.types[name]
        if r.warm:
            n = 64
        times = _linear_times(device, type_name, n, k, WARM_ROWS if r.warm else (1, 64, 256, 1024),
                              copies=1 if r.warm else 3)
        nbytes = n * ggml_type(type_name).row_bytes(k)
        one = times[1][0]
        if type_name == "Q4_K" and not r.warm:
            q4k_bytes, q4k_ms = q4k_bytes + nbytes, q4k_ms + one
            worst = max(worst, *(times[m][0] / times[m][1] for m in (64, 256, 1024)))
        rows.append([name, type_name, f"{n} x {k}", f"{one:.3f}", f"{nbytes / (one / 1e3) / r.hbm:.0%}",
                     *(f"{times[m][0] / times[m][1]:.2f}" for m in (64, 256, 1024) if m in times)])
    if not r.warm:
        r.values["q4k_1row_bandwidth_fraction"] = round(q4k_bytes / (q4k_ms / 1e3) / r.hbm, 3)
        r.values["q4k_64row_vs_bf16"] = round(worst, 3)
    return (_table(["linear", "type", "shape", "1 row ms", "of bandwidth", "64 rows vs bf16", "256", "1024"], rows) +
            "\n\nGoals: Q4_K at 1 row >= 60% of the bandwidth; at >= 64 rows <= 1.5x bf16 cuBLAS.")


def slice_sweep(r: Report, device: torch.device) -> str:
    shape = SHAPES["70b"]
    if r.warm:  # one layer of the same shapes
        shape = replace(shape, layers=1)
    streamed = StreamedSlice(shape, device)
    stack = Stack(shape, device, resident=False, head=False, capacity=1600)
    link_ms = streamed.bytes_per_pass / r.pinned * 1e3
    rows, times = [], {}
    for n in (WARM_ROWS if r.warm else ROWS):
        h, cos, sin, slots, keys = stack.inputs(n)
        streamed.streamer.settle()
        times[n] = time_ms(lambda: streamed.run(stack, h, cos, sin, slots, keys), device, repeats=3 if n > 256 else 5)
        rows.append([n, f"{times[n]:.1f}", f"{times[n] / link_ms:.2f}"])
    streamed.close()
    free_cuda(streamed, stack)
    if not r.warm:
        r.values["slice_pass_vs_link"] = round(max(times[n] for n in ROWS if n <= 256) / link_ms, 3)
        r.values["slice_1024_vs_1"] = round(times[1024] / times[1], 3)
    return (f"{shape.name}: {streamed.bytes_per_pass / 1e9:.2f} GB of blocks per pass, streamed from pinned RAM "
            f"(link time {link_ms:.1f} ms at the measured pinned bandwidth); a random tree over 512 cached tokens.\n\n"
            + _table(["tokens", "pass ms", "vs link"], rows) +
            "\n\nGoals: 1-256 tokens <= 1.15x the link time; 1,024 tokens <= 1.3x one token.")


def _stack_times(r: Report, device, key: str, sizes, head_rows: bool, layers=None):
    shape = SHAPES[key] if layers is None else replace(SHAPES[key], layers=layers)
    stack = Stack(shape, device, capacity=2048)
    graphs = Graphs.on(device)
    rows = {}
    for n in sizes:
        h, cos, sin, slots, keys = stack.inputs(n)
        step = lambda *a: stack.run(*a, head_rows=head_rows)  # noqa: E731
        eager = time_ms(lambda: step(h, cos, sin, slots, keys.prefix, keys.gather, keys.count), device)
        graphed = time_ms(lambda: run_bucketed(graphs, key, step, h, cos, sin, slots, keys), device)
        rows[n] = (eager, graphed)
    free_cuda(stack, graphs)
    return rows


def draft_sweep(r: Report, device: torch.device) -> str:
    sizes = (1, 32, 64) if r.warm else (1, 2, 4, 8, 16, 32, 64)
    times = _stack_times(r, device, "0.5b", sizes, True, layers=2 if r.warm else None)
    if not r.warm:
        r.values["draft_step_ms"] = round(max(min(t) for t in times.values()), 3)
    return (f"{SHAPES['0.5b'].name} twin, resident: a step = every layer over 512 cached tokens and the step's "
            f"nodes, the final norm, the whole LM head ({SHAPES['0.5b'].vocab} rows) and its top 8.\n\n" +
            _table(["nodes", "eager ms", "CUDA graph ms"], [[n, f"{e:.2f}", f"{g:.2f}"] for n, (e, g) in
                                                           times.items()]) +
            "\n\nGoal: <= 5 ms up to 64 nodes (`draft_step_ms`: the worst size, the faster of the two).")


def target_sweep(r: Report, device: torch.device) -> str:
    sizes = WARM_ROWS if r.warm else ROWS
    times = _stack_times(r, device, "1.5b", sizes, False, layers=2 if r.warm else None)
    head = _linear_times(device, SHAPES["1.5b"].types["head"], SHAPES["1.5b"].vocab, SHAPES["1.5b"].hidden, (1,),
                         copies=1)[1][0] if not r.warm else 0.0
    if not r.warm:
        r.values["target_alone_tok_s"] = round(1e3 / (min(times[1]) + head), 1)
    return (f"{SHAPES['1.5b'].name} twin, resident, a random tree over 512 cached tokens; the LM head's one row "
            f"{head:.3f} ms.\n\n" +
            _table(["tokens", "eager ms", "CUDA graph ms"], [[n, f"{e:.2f}", f"{g:.2f}"] for n, (e, g) in
                                                            times.items()]) +
            "\n\nGoal: the target alone >= 100 tok/s (`target_alone_tok_s`: a one-token pass, graphed, plus the "
            "head's row; the engine's Python per token is not in it).")


def projection(r: Report) -> str:
    from offspec.profile.auto import prior_acceptance
    from offspec.profile.projection import Assumptions, project
    from offspec.profile.store import load_profile, resolve_reference

    hw = load_profile(resolve_reference("rtx4090"))["hardware"]
    acceptance, source = prior_acceptance()  # measured with the default pair
    assume = Assumptions()
    bw, ratio = r.values["q4k_1row_bandwidth_fraction"], r.values["q4k_64row_vs_bf16"]
    if bw and ratio:  # this run's kernels: their share of the bandwidth, and of cuBLAS's FLOP/s (at 50%)
        assume = replace(assume, memory_efficiency=min(0.95, bw),
                         compute_efficiency=min(0.9, max(0.05, assume.compute_efficiency / ratio)))
    p = project(hw, 70e9, "q4_k_m", 0.5e9, acceptance, source, assume=assume)
    r.values["projection_4090_70b_tok_s"] = round(p.plan.best.tokens_per_second, 2)
    return (f"`offspec plan --hardware rtx4090 --target-params 70B --quant q4_k_m --draft-params 0.5B` with this "
            f"run's kernel efficiencies (memory {assume.memory_efficiency:.0%}, compute "
            f"{assume.compute_efficiency:.0%}): {p.plan.best.tokens_per_second:.2f} tok/s at budget "
            f"{p.plan.best.budget} (largest tree {p.placement['max_budget']}); acceptance: {source}.")


def lossless(r: Report, junit: Path) -> str:
    """From the junit file of the `pytest -m cuda` run: did greedy speculation equal the target alone in bf16?"""
    cases = [c for c in ET.parse(junit).getroot().iter("testcase")
             if c.get("name", "").startswith("test_greedy_speculation_equals_the_target_alone_in_bfloat16")]
    ran = [c for c in cases if c.find("skipped") is None]
    passed = [c for c in ran if c.find("failure") is None and c.find("error") is None]
    r.values["lossless_bf16"] = bool(ran) and len(passed) == len(cases)
    return f"{len(passed)} of {len(cases)} lossless-in-bfloat16 tests passed ({len(cases) - len(ran)} skipped)."


def pytest_cuda(r: Report, junits: list[Path]) -> str:
    r.values["pytest_cuda_failed"] = gpu_e2e.pytest_failures(junits)
    return (f"`pytest -m cuda`: {r.values['pytest_cuda_failed']} failed or errors "
            f"({', '.join(j.name for j in junits)}). Goal: 0.")


def e2e_resident(r: Report, twins: Path, work: Path) -> str:
    bench = work / "e2e-bench"
    log = work / "e2e-bench.log"
    gpu_e2e.run(gpu_e2e.bench_command(twins, bench), r.seconds_left() - 60, log, check=False)  # 1: a mismatch
    r.values.update(gpu_e2e.bench_keys(gpu_e2e.read_json(bench / "bench.json", log)))
    return (f"`offspec bench --budgets ar,16,64,256,1024` on the default pair's twins, resident: ar "
            f"{r.values['e2e_ar_tok_s']} tok/s; a 64-node tree's target pass "
            f"{r.values['e2e_tree64_pass_vs_ar_pass']}x a one-token pass (goal <= 1.3); greedy runs unlike ar: "
            f"{r.values['e2e_greedy_mismatches']} (goal 0). Goal: ar >= 150 tok/s.")


def e2e_streamed(r: Report, twins: Path, work: Path) -> str:
    mem = gpu_e2e.min_device_mem(twins / "t.gguf")
    bench = work / "e2e-offload"
    log = work / "e2e-offload.log"
    gpu_e2e.run(gpu_e2e.offload_command(twins / "t.gguf", mem, bench), r.seconds_left() - 45, log)
    report = gpu_e2e.read_json(bench / "offload-bench.json", log)
    r.values["e2e_streamed_pass_vs_link"] = gpu_e2e.streamed_vs_link(report)
    rows = [[row["tokens"], f"{row['seconds'] * 1e3:.1f}", f"{row['seconds'] / report['stream_bound_seconds']:.2f}"]
            for row in report["offspec"]]
    return (f"`offspec bench offload --device-mem {mem}` on the target twin: {report['placement'].get('layers')} "
            f"layers; link time {report['stream_bound_seconds'] * 1e3:.1f} ms ({report['raw_link']}).\n\n"
            + _table(["tokens", "pass ms", "vs link"], rows) + "\n\nGoal: <= 1.3 up to 64 tokens.")


def peer(r: Report, device: torch.device) -> str:
    shape = SHAPES["1.5b"]
    t0 = time.monotonic()
    model = gpu_e2e.peer_model(device, shape.hidden, shape.inter, shape.layers, shape.heads, shape.kv_heads,
                               shape.vocab)
    made = time.monotonic() - t0
    rate = gpu_e2e.peer_tok_s(model)
    free_cuda(model)
    r.values["e2e_vs_transformers"] = gpu_e2e.ratio(r.values["e2e_ar_tok_s"], rate)
    return (f"transformers' generate() of {shape.name}'s shapes, random bfloat16 weights made on the GPU "
            f"({made:.0f} s): {rate} tok/s (128 new tokens after 200, greedy, prefill included, the second of two "
            f"runs). offspec's ar over it: {r.values['e2e_vs_transformers']} (goal >= 5).")


def markdown(r: Report) -> str:
    lines = ["# GPU check (scripts/gpu_check.sh)", "", f"{r.values['device']}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Written by the script; see docs/gpu-design.md for what each figure "
             "measures.", "", "```json", json.dumps(r.json(), indent=1), "```", ""]
    for title, body in r.sections:
        lines += [f"## {title}", "", body, ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="gpu-check.json, .md and -errors.log go here")
    ap.add_argument("--work", type=Path, help="the e2e commands' outputs and logs (default: --out)")
    ap.add_argument("--junit", type=Path, action="append", default=[], help="a `pytest -m cuda` run's junit file")
    ap.add_argument("--twins", type=Path, help="the default pair's GGUF twins (t.gguf, d.gguf), converted")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds this script may take")
    ap.add_argument("--warm", action="store_true", help="compile every kernel, time nothing, write nothing")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    r = Report(time.monotonic() + args.deadline, args.warm, None if args.warm else args.out / "gpu-check-errors.log")
    r.hbm = r.pinned = r.bf16_flops = None
    r.section("Device", environment, device)
    if not args.warm:
        if args.junit:
            r.section("pytest -m cuda", pytest_cuda, args.junit)
            if args.junit[0].exists():
                r.section("Lossless in bfloat16 (pytest -m cuda)", lossless, args.junit[0])
        if args.twins is not None:
            r.section("End to end: offspec bench on the twins, resident", e2e_resident, args.twins, work)
            r.section("End to end: transformers' generate() on the same shapes", peer, device)
            r.section("End to end: the target twin streamed from pinned RAM", e2e_streamed, args.twins, work)
    for title, fn in (("Kernel table", kernel_table), ("The 70B slice's linears", q4k_slice),
                      ("Draft step sweep (0.5B twin)", draft_sweep), ("Target pass sweep (1.5B twin)", target_sweep),
                      ("Pass sweep of the 70B slice, streamed", slice_sweep)):
        if r.hbm is not None:
            r.section(title, fn, device)
    if args.warm:
        return 0
    r.section("Projection: 70B Q4_K_M on an RTX 4090", projection)
    (args.out / "gpu-check.json").write_text(json.dumps(r.json(), indent=1) + "\n")
    (args.out / "gpu-check.md").write_text(markdown(r))
    print(json.dumps(r.json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
