"""`offspec profile`'s work: measure the hardware and the loaded pair, plan, and assemble the profile dict."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

from offspec.offload.estimates import FLOP_EFFICIENCY, matmul_params
from offspec.config import LoadConfig
from offspec.progress import ProgressFn, no_progress
from offspec.version import __version__

from .auto import pair_key
from .hardware import measure_hardware
from .measure import FULL, QUICK, MeasureConfig, calibration_prompts, measure_pair
from .coverage import coverage_of
from .planner import Plan, PlannerConfig, plan
from .routing import unmissed_read_seconds
from .store import acceptance_of, costs_of, fingerprint


def model_params(model: Any) -> Optional[int]:
    try:
        return int(sum(p.numel() for p in model.parameters()))
    except Exception:  # an offloaded model may hold parameters outside the module tree
        return None


def build_profile(generator, load_cfg: LoadConfig, *, quick: bool = False, prompts: Optional[list[dict]] = None,
                  config: Optional[MeasureConfig] = None, progress: ProgressFn = no_progress) -> tuple[dict, Plan]:
    """Measure everything and return (the profile dict, its plan). Nothing is written here."""
    engine, info = generator.engine, generator.info
    config = config or (QUICK if quick else FULL)
    prompts = prompts if prompts is not None else calibration_prompts(config.prompts)
    hardware = measure_hardware(engine.target.device, engine.target.dtype, load_cfg.offload.offload_dir,
                                quick=quick, progress=progress)
    measured = measure_pair(generator, config, prompts, progress)
    flops = hardware.get("device_flops")
    if flops:  # the planner's FLOP term: a pass past the sizes measured computes at least this long per token
        usable = float(flops) * FLOP_EFFICIENCY
        measured["timings"]["target_flop_seconds"] = 2 * matmul_params(engine.target.model.config) / usable
        if engine.drafter.runner is not None:
            measured["timings"]["draft_flop_seconds"] = 2 * matmul_params(engine.drafter.runner.model.config) / usable
    experts = measured.get("experts")
    if experts and experts["read_as_routed"] and experts["read_seconds"] is None:  # no calibration pass missed:
        rates = {"link": hardware.get("h2d_pinned_bytes_per_s") or hardware.get("host_memory_bandwidth"),
                 "disk": hardware.get("disk_read_bytes_per_s")}  # measured: a CPU's link is its memory copy
        seconds = unmissed_read_seconds(engine.target.model, info.extra.get("placement") or {}, rates)
        if seconds is not None:
            experts["read_seconds"] = round(seconds, 7)
    key = pair_key(generator, load_cfg)
    models = {"target": info.target, "draft": info.draft, "dtype": info.dtype,
              "target_params": model_params(engine.target.model),
              "draft_params": model_params(engine.drafter.runner.model) if engine.drafter.runner is not None else None,
              "quant": load_cfg.offload.quant, "draft_quant": load_cfg.offload.draft_quant,
              "draft_vocab": info.extra.get("draft_vocab"), "placement": info.extra.get("placement")}
    data = {"format": "offspec-profile", "version": 1, "kind": "measured",
            "name": f"{hardware['device_name']}: {info.target} + {info.draft}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "offspec_version": __version__,
            "sources": [f"measured by `offspec profile{' --quick' if quick else ''}` on this machine: "
                        f"{len(prompts)} calibration prompts (offspec/data/calibration.jsonl), greedy verification, "
                        f"every drafter ({', '.join(engine.drafter.modes)})"],
            "fingerprint": fingerprint(key), "key": key, "quick": quick, "hardware": hardware, "models": models,
            **measured}
    drafter = generator.tree.drafter  # the plan is for the drafter the pair loads with (auto plans each one)
    chosen = plan(costs_of(data), acceptance_of(data, drafter=drafter),
                  PlannerConfig(branch=generator.tree.branch, max_budget=engine.max_budget, drafter=drafter))
    if experts and chosen.coverage is None:  # a resident mixture: its curve is reported, not priced
        chosen = replace(chosen, coverage=coverage_of(experts))
    data["plan"] = chosen.summary()
    return data, chosen
