"""What the machine did during `offspec bench`: the raw read of a streamed target's layer files, and a memory copy
before each prompt with the target on a CPU, kept in the report and said under its table. A slow spell of the
disk or the memory then shows apart from slow code."""

from __future__ import annotations

import time

from offspec.profile.hardware import memory_bandwidth
from offspec.store.packed import ssd_files

from .bench_offload import ssd_read

# A copy well past any CPU's last-level cache (read and written: twice this moved), about 0.1 s a prompt.
MEMORY_PROBE_BYTES = 128 * 2**20
MEMORY_SPREAD_NOTED = 1.15  # probes further apart than this: the table says the machine's speed moved


def disk_check(generator, report: dict, at_prompt: int) -> None:
    """With a target streamed from SSD, read its streamed layer files once the way the passes do (O_DIRECT)
    and append the raw read speed to `report["disk_checks"]`."""
    placement = generator.info.extra.get("placement") or {}
    if not placement.get("packed_dir"):
        return
    files = ssd_files(placement["packed_dir"], placement.get("tiers", []))
    if not files:
        return
    raw = ssd_read(files, repeats=1)
    report.setdefault("disk_checks", []).append(
        {"at_prompt": at_prompt, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "ssd_read": raw["ssd_read"],
         "ssd_read_bytes": raw["ssd_read_bytes"], "ssd_read_mode": raw["ssd_read_mode"]})


def memory_check(generator, report: dict, at_prompt: int) -> None:
    """With the target on a CPU, time a memory copy before the prompt and append its bandwidth to
    `report["memory_checks"]`. A resident target's pass reads every weight from memory, and cloud VMs switch
    between memory speeds for seconds to minutes (a 2-vCPU EPYC: a copy at 34 or at 50-60 GB/s, a one-token pass
    at 28 or 21 ms; docs/benchmarks.md): the probes show when a run's speed moved with the machine. Not with a
    streamed target: its passes wait for the disk (`disk_check`), and the copy's 256 MB, outside the memory budget
    the placement fitted, killed `--device-mem 1GB` runs inside a 1000M memory cgroup."""
    layers = (generator.info.extra.get("placement") or {}).get("layers") or {}
    if generator.info.device != "cpu" or layers.get("ram") or layers.get("ssd"):
        return
    import torch

    report.setdefault("memory_checks", []).append(
        {"at_prompt": at_prompt, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
         "copy_bytes_per_s": memory_bandwidth(torch.device("cpu"), MEMORY_PROBE_BYTES)})


def machine_notes(report: dict) -> list[str]:
    """The lines under the table that say what the probes read."""
    lines = []
    memory = [c["copy_bytes_per_s"] for c in report.get("memory_checks", [])]
    if memory:
        low, high = min(memory), max(memory)
        moved = (f", {high / low:.2f}x apart: the machine's memory speed moved during the run (the set-ups ran "
                 f"prompt by prompt in turn, so each prompt's runs saw alike)" if high > MEMORY_SPREAD_NOTED * low else "")
        lines.append(f"\nMemory copy bandwidth before each prompt: {low / 1e9:.1f}-{high / 1e9:.1f} GB/s over "
                     f"{len(memory)} prompts{moved}.")
    checks = report.get("disk_checks")
    if checks:
        read = ", ".join(f"{c['ssd_read'] / 1e9:.2f} GB/s at prompt {c['at_prompt']}" for c in checks)
        lines.append(f"\nRaw read of the streamed layer files ({checks[0]['ssd_read_mode']}): {read}.")
    return lines
