"""`offspec bench offload`: what streaming costs, beside accelerate's own offloading under the same placement.

Measures, for the target under the given budgets:
- the raw bandwidth of the link the streamed layers cross: pinned host -> device copies on a GPU; on a CPU
  machine SSD -> RAM reads of the packed layer files with O_DIRECT (the page cache is bypassed, so nothing is
  served from RAM), plus RAM -> RAM memcpy (the link of the RAM tier);
- one forward pass of 1, 16, 64, 256, 1024 and 4096 tokens (over a short cached prefix): its time, the bytes
  streamed, the time spent waiting for weights and the achieved streaming bandwidth (bytes / pass time).
  Passes run back to back, so the first ring slots and staging buffers of a pass were filled during the
  previous pass's last layers (as they are during drafting in real use);
- the same passes with accelerate's offloading (`device_map` with the same layers on the device / in RAM /
  on disk, `offload_folder`), with the page cache of its weight files dropped before each pass
  (posix_fadvise DONTNEED), so that its "disk" layers come from the disk too.
Writes offload-bench.json and offload-bench.png (matplotlib, Agg) into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from offspec.api import check_options
from offspec.errors import OffspecError, run_cli
from offspec.formats.cpu_linear import _skinny_forward, speed_up_cpu_linears
from offspec.formats.gpu.choice import cuda_kernels
from offspec.models.loading import load_model
from offspec.models.sources import resolve_model
from offspec.offload.diskio import FileReader, aligned_empty
from offspec.offload.hostmem import drop_cached
from offspec.offload.model import load_offloaded
from offspec.offload.skeleton import _empty_model
from offspec.profile.hardware import host_to_device
from offspec.spec.runner import ModelRunner
from offspec.store.packed import ssd_files
from offspec.util.device import check_device_budget, sync_compute, use_device
from offspec.util.files import atomic_write
from offspec.util.hf import quiet_transformers
from offspec.util.sizes import format_size

from .args import add_model_args, load_options
from .progress import TqdmProgress

TOKENS = "1,16,64,256,1024,4096"
_TREE_OPTIONS = ("budget", "max_beams", "branch", "max_depth", "drafter")  # the bench runs passes, no trees


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec bench offload", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tokens", default=TOKENS, help=f"tokens per measured pass, comma list (default {TOKENS})")
    p.add_argument("--context", type=int, default=32, help="cached prefix tokens before each pass (default 32)")
    p.add_argument("--repeat", type=int, default=3, help="passes per point; the median is kept (default 3)")
    p.add_argument("--no-accelerate", action="store_true", help="skip the accelerate comparison")
    p.add_argument("--out", default="bench-offload", help="output directory (default bench-offload)")
    return p


# --- raw bandwidths ------------------------------------------------------------------------------
def raw_bandwidths(device: torch.device, ssd_files: list[Path], max_bytes: int = 4 * 10**9, repeats: int = 3) -> dict:
    """Bytes/s of the links: host -> device (GPU), SSD -> RAM with O_DIRECT (median of `repeats` reads of up to
    `max_bytes` of the streamed files), RAM -> RAM memcpy."""
    out: dict[str, Any] = {}
    if device.type == "cuda":  # best of 5 copies of 1 GiB on `device`; the pinned buffer is unpinned right after
        out["host_to_device"], out["host_to_device_pageable"] = host_to_device(device, 1 << 30, repeats=5)
    if ssd_files:
        out.update(ssd_read(ssd_files, max_bytes, repeats))
    a = torch.empty(256 * 2**20, dtype=torch.uint8)  # (256 MiB,) memcpy source
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    out["ram_copy"] = 4 * a.numel() / (time.perf_counter() - t0)
    return out


def ssd_read(files: list[Path], max_bytes: int = 4 * 10**9, repeats: int = 3) -> dict:
    """SSD -> RAM bytes/s reading `files` the way the streamer does (O_DIRECT where possible, whole files in
    turn): the median of `repeats` reads of up to `max_bytes`."""
    reader = FileReader(direct=True)
    buf = aligned_empty(max(f.stat().st_size for f in files))  # (largest file,) one file at a time
    rates, total = [], 0
    for _ in range(repeats):
        total, seconds = 0, 0.0
        for f in files:
            if total >= max_bytes:
                break
            nbytes = f.stat().st_size
            seconds += reader.read(f, buf, nbytes)
            total += nbytes
        rates.append(total / seconds)
    mode = reader.mode + (" (O_DIRECT: page cache bypassed)" if reader.mode == "direct" else
                          " (pages dropped after each read)")
    return {"ssd_read": statistics.median(rates), "ssd_read_all": rates, "ssd_read_mode": mode,
            "ssd_read_bytes": total}


# --- passes ----------------------------------------------------------------------------------------
def measure_passes(model, tokens: list[int], context: int, repeat: int, io=None,
                   before_pass=None) -> list[dict]:
    """Median time of one forward of q tokens over `context` cached tokens, for each q in `tokens`."""
    runner = ModelRunner(model, capacity=context + max(tokens))
    runner.io = io
    device = runner.device
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(0)
    runner.extend(torch.randint(0, vocab, (context,), generator=gen).tolist())
    rows = []
    for q in tokens:
        ids = torch.randint(0, vocab, (q,), generator=gen).to(device)  # (q,)
        pos = torch.arange(context, context + q, device=device)  # (q,)
        visible = torch.ones((q, context + q), dtype=torch.bool, device=device)  # (q, context + q) causal
        visible[:, context:] = torch.ones((q, q), dtype=torch.bool, device=device).tril()
        times, streamed, waited = [], [], []
        for _ in range(repeat):
            runner.cache.truncate(context)
            if before_pass is not None:
                before_pass()
            io0 = runner.io_counters()
            sync_compute(device)  # sync: the compute stream only; the copy stream reads ahead as between passes
            t0 = time.perf_counter()
            runner.forward(ids, pos, pos, visible)
            sync_compute(device)
            times.append(time.perf_counter() - t0)
            io1 = runner.io_counters()
            streamed.append(io1[0] - io0[0])
            waited.append(io1[1] - io0[1])
        i = times.index(statistics.median_low(times))
        rows.append({"tokens": q, "seconds": times[i], "all_seconds": times, "bytes_streamed": streamed[i],
                     "wait_seconds": waited[i], "achieved_bandwidth": streamed[i] / times[i] if times[i] else 0.0})
    return rows


# --- accelerate ------------------------------------------------------------------------------------
def accelerate_model(resolved: Any, tiers: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                     offload_folder: Path, prefix: str):
    """The model through accelerate's offloading with the same layers on the device / in RAM / on disk. A
    converted GGUF is loaded from the GGUF itself: transformers dequantizes it (accelerate has no ggml kernels)."""
    from transformers import AutoModelForCausalLM


    path = Path(resolved.path)
    on_device = (device.index or 0) if device.type == "cuda" else "cpu"
    where = {"device": on_device, "ram": "cpu", "ssd": "disk"}
    skeleton = _empty_model(path, dtype, "sdpa")
    device_map: dict[str, Any] = {}  # every module that holds tensors outside the layers stays on the device
    for name, module in skeleton.named_modules():
        if name and not name.startswith(prefix) and (module._parameters or module._buffers) and \
                not any(name.startswith(k + ".") for k in device_map):
            device_map[name] = where["device"]
    del skeleton
    for i, tier in enumerate(tiers):
        device_map[f"{prefix}{i}"] = where[tier]
    with quiet_transformers():
        source = {"pretrained_model_name_or_path": str(path)}
        if getattr(resolved, "gguf", None) is not None:
            source = {"pretrained_model_name_or_path": str(resolved.gguf.parent), "gguf_file": resolved.gguf.name}
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype, device_map=device_map,
                                                     offload_folder=str(offload_folder))
    model.eval()
    if device.type == "cpu" and dtype == torch.float32:  # the same few-row CPU matmul offspec uses
        import types


        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                if hasattr(module, "_old_forward"):  # under accelerate's hook wrapper
                    module._old_forward = types.MethodType(_skinny_forward, module)
                else:
                    module.forward = types.MethodType(_skinny_forward, module)
    return model


def drop_page_cache(paths: list[Path]) -> None:
    """`offload.hostmem.drop_cached` on each file: its clean cached pages are dropped (pages mapped elsewhere stay)."""
    for path in paths:
        try:
            drop_cached(path)
        except OSError:
            continue  # a file that cannot be opened keeps its pages


# --- report ----------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = report["offspec"]
    xs = [r["tokens"] for r in rows]
    ax1.plot(xs, [r["seconds"] for r in rows], "o-", label="offspec")
    if report.get("accelerate"):
        acc = report["accelerate"]
        ax1.plot([r["tokens"] for r in acc], [r["seconds"] for r in acc], "s-", label="accelerate offload")
    bound = report.get("stream_bound_seconds")
    if bound:
        ax1.axhline(bound, color="gray", ls="--", label="bytes per pass / raw bandwidth")
    ax1.set(xscale="log", yscale="log", xlabel="tokens per pass", ylabel="pass time (s)", title="forward pass time")
    ax1.legend()
    ax2.plot(xs, [r["achieved_bandwidth"] / 1e9 for r in rows], "o-", label="achieved (bytes streamed / pass time)")
    raw = report.get("raw_link_bandwidth")
    if raw:
        ax2.axhline(raw / 1e9, color="gray", ls="--", label=f"raw: {report['raw_link']}")
    ax2.set(xscale="log", xlabel="tokens per pass", ylabel="GB/s", title="streaming bandwidth")
    ax2.set_ylim(bottom=0)
    ax2.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"{report['model']} on {report['device']} ({report['placement']['layers']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(report: dict) -> str:
    acc = {r["tokens"]: r for r in report.get("accelerate") or []}
    lines = ["| tokens | offspec s | waiting s | GB streamed | achieved GB/s | accelerate s | accelerate / offspec |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["offspec"]:
        a = acc.get(r["tokens"])
        head = (f"| {r['tokens']} | {r['seconds']:.3f} | {r['wait_seconds']:.3f} | {r['bytes_streamed'] / 1e9:.2f} | "
                f"{r['achieved_bandwidth'] / 1e9:.2f} |")
        lines.append(head + (f" {a['seconds']:.3f} | {a['seconds'] / r['seconds']:.2f} |" if a else " | |"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    tokens = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    if not tokens or tokens[0] <= 0:
        raise OffspecError(f"--tokens must be positive integers, got {args.tokens!r}")
    options = {k: v for k, v in load_options(args).items() if k not in _TREE_OPTIONS}
    plan = check_options(**options, budget=1)
    load_cfg = plan.load
    # the bench's own cache, its limits as given (none lowered to fit)
    offload = replace(load_cfg.offload, max_context=args.context + 1, max_budget=max(tokens) - 1, fit_limits=(),
                      min_budget=1)
    device, dtype = plan.device, plan.dtype
    use_device(device)
    check_device_budget(device, offload.device_mem)
    with TqdmProgress() as progress:  # closed before any error or `interrupted` line
        resolved = resolve_model(load_cfg.target, "target", progress=progress)
        model, handle = load_offloaded(resolved, device=device, dtype=dtype, attn_implementation="sdpa",
                                       config=offload, progress=progress)
        if model is None:
            model = load_model(resolved, device=device, dtype=dtype, progress=progress).model
    if device.type == "cpu":
        speed_up_cpu_linears(model)
    elif device.type == "cuda" and cuda_kernels() == "triton":  # as offspec.load does: no traceback mid-pass
        from offspec.formats.gpu.probe import check_models

        fallback = check_models(device, dtype, [model])
        if fallback is not None:
            print(f"offspec: {fallback}", file=sys.stderr)
    placement = handle.placement
    ssd = ssd_files(handle.packed_dir, placement.tiers) if handle.packed_dir else []
    raw = raw_bandwidths(device, ssd)
    if device.type == "cuda":
        raw_link, raw_bw = "pinned host -> device copy", raw["host_to_device"]
    elif ssd:
        raw_link, raw_bw = f"SSD -> RAM read, {raw['ssd_read_mode']}", raw["ssd_read"]
    else:
        raw_link, raw_bw = "RAM -> RAM memcpy", raw["ram_copy"]
    io = handle.streamer
    print(f"offspec: {placement.describe()}", file=sys.stderr)
    rows = measure_passes(model, tokens, args.context, args.repeat, io=io)
    stats = io.stats() if io is not None else {}
    prefix = _layers_prefix(model)
    if io is not None:
        io.close()  # the ring, the staging buffers and the RAM-tier copies (pinned on CUDA) go now, not at exit
    del model, io
    handle.streamer = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # offspec's device memory back to the driver before accelerate loads

    accelerate_rows = None
    accelerate_note = None
    if not args.no_accelerate:
        with tempfile.TemporaryDirectory(prefix="offspec-accelerate-") as folder:
            print("accelerate: loading with the same placement", file=sys.stderr)
            acc = accelerate_model(resolved, placement.tiers, device, dtype, Path(folder), prefix)
            files = sorted(Path(folder).rglob("*")) + sorted(resolved.path.glob("*.safetensors"))
            files = [f for f in files if f.is_file()]
            accelerate_rows = measure_passes(acc, tokens, args.context, args.repeat,
                                             before_pass=lambda: drop_page_cache(files))
            accelerate_note = ("page cache of the offload folder and of the checkpoint dropped before each pass "
                               "(posix_fadvise DONTNEED; pages mapped by other processes stay cached)")
            del acc
            gc.collect()

    report = {
        "model": resolved.name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "quant": offload.quant, "placement": handle.summary(), "context": args.context, "repeat": args.repeat,
        "raw": raw, "raw_link": raw_link, "raw_link_bandwidth": raw_bw,
        "stream_bound_seconds": placement.bytes_per_pass / raw_bw if raw_bw else None,
        "offspec": rows, "streamer": stats, "accelerate": accelerate_rows, "accelerate_note": accelerate_note,
        "ratio_accelerate_over_offspec": {str(a["tokens"]): a["seconds"] / r["seconds"]
                                          for a, r in zip(accelerate_rows or [], rows)},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu_threads": torch.get_num_threads(), "machine": platform.machine(),
                        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
    }
    return report


def _layers_prefix(model) -> str:
    layers = model.get_decoder().layers
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(layers)] + "."


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "offload-bench.json", json.dumps(report, indent=2), fsync=False)
    plot(report, out / "offload-bench.png")
    print(f"{report['model']} on {report['device']}: {report['placement']['layers']}, "
          f"{format_size(report['placement']['bytes_per_pass'])} per pass; raw link {report['raw_link']}: "
          f"{report['raw_link_bandwidth'] / 1e9:.2f} GB/s")
    print(_table(report))
    print(f"wrote {out / 'offload-bench.json'} and {out / 'offload-bench.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
