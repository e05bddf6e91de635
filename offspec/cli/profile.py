"""`offspec profile` and `offspec plan`: argument parsing and rendering (the library never prints).

    offspec profile [--target X] [--draft Y] [--quick] [--out FILE]
    offspec plan --hardware profiles/rtx4090.json --target-params 70B --quant nf4 [--acceptance FILE]

Errors a user can fix are one `error:` line on stderr (exit 2); Ctrl-C exits 130 and never leaves a
partial profile (files are written to a temp name and renamed).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import offspec
from offspec.api import check_options
from offspec.errors import OffspecError, run_cli
from offspec.models.self_draft import self_draft_type
from offspec.profile import builder, measure, report
from offspec.profile.auto import prior_acceptance
from offspec.profile.projection import Assumptions, parse_bytes, parse_params, project
from offspec.profile.store import load_acceptance, load_profile, profile_path, resolve_reference, save_profile

from .args import add_model_args, load_options
from .progress import TqdmProgress

_TREE_FLAGS = ("budget", "max_beams", "max_depth")  # planned by the profile (the branch is the user's)


def _run(fn, args) -> int:
    return run_cli(lambda: fn(args), interrupted="interrupted; no profile was written")


# --- offspec profile ---------------------------------------------------------------------------------
def profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec profile", description="Measure this machine and the model pair "
                                "(hardware, pass times, draft step times, acceptance curve), choose the tree "
                                "and save the profile that --budget auto uses.")
    add_model_args(p)
    g = p.add_argument_group("profiling")
    g.add_argument("--quick", action="store_true",
                   help="fewer sizes, prompts and passes (about a minute on a small pair)")
    g.add_argument("--out", metavar="FILE", help="also write the profile here (a PNG plot goes next to it)")
    g.add_argument("--no-save", action="store_true",
                   help="do not save it in the config dir (--budget auto will not see it)")
    g.add_argument("--prompts", type=int, metavar="N", help="calibration prompts to use (default 30, 4 with --quick)")
    g.add_argument("--passes", type=int, metavar="N", help="speculative passes per prompt (default 8, 4 with --quick)")
    g.add_argument("--calibration", metavar="FILE", help="your own prompts (JSONL or text) instead of the shipped ones")
    g.add_argument("--max-tree", type=int, metavar="N", help="largest budget whose acceptance is measured "
                   "(default: the largest whose target pass costs <= 16x a 1-token pass, 6x with --quick)")
    return p


def _cmd_profile(args: argparse.Namespace) -> int:
    options = {k: v for k, v in load_options(args).items() if k not in _TREE_FLAGS}
    options["budget"] = 4  # a fixed budget: no start-up estimate (the calibration sets its own trees)
    config = measure.QUICK if args.quick else measure.FULL
    if args.prompts is not None or args.passes is not None or args.max_tree is not None:
        config = replace(config, prompts=args.prompts or config.prompts, passes=args.passes or config.passes,
                         **({"forced_budget": args.max_tree} if args.max_tree else {}))
    if min(args.prompts or 1, args.passes or 1, args.max_tree or 1) <= 0:
        raise OffspecError("--prompts, --passes and --max-tree must be positive")
    prompts = measure.calibration_prompts(config.prompts, Path(args.calibration) if args.calibration else None)
    with TqdmProgress() as progress:  # closed before any error or `interrupted` line
        generator = offspec.load(progress=progress, **options)
        generator.threads = None  # one thread count (sized at load) for every measurement of the profile
        data, chosen = builder.build_profile(generator, check_options(**options).load, quick=args.quick, prompts=prompts, config=config,
                                             progress=progress)
    written = []
    if not args.no_save:
        written.append(save_profile(data, profile_path(data["key"])))
    if args.out:
        written.append(save_profile(data, Path(args.out)))
    title = f"{generator.info.target} + {generator.info.draft} on {data['hardware']['device_name']}"
    plots = [report.plot(chosen, path.with_suffix(".png"), title) for path in written]

    out = sys.stdout
    print(f"profile of {generator.info.target} (target) + {generator.info.draft} (draft), "
          f"{generator.info.device} {generator.info.dtype}{' (quick)' if args.quick else ''}", file=out)
    print("\n".join(report.hardware_lines(data["hardware"])), file=out)
    print("\n" + report.timings_table(data["timings"]), file=out)
    acc = data["acceptance"]
    print(f"\nacceptance ({acc['prompts']} prompts, {acc['passes']} passes, greedy):", file=out)
    print(report.acceptance_table(acc), file=out)
    print("\n" + report.plan_table(chosen), file=out)
    print("\n" + report.plan_summary(chosen), file=out)
    for path in written + plots:
        print(f"written: {path}", file=out)
    if not args.no_save:
        print("`--budget auto` (the default) now uses this profile for this machine, pair and placement", file=out)
    return 0


def profile_main(argv: Optional[list[str]] = None) -> int:
    return _run(_cmd_profile, profile_parser().parse_args(argv))


# --- offspec plan ------------------------------------------------------------------------------------
def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec plan", description="PROJECT tokens/s for hardware you may not have, "
                                "from a hardware profile and an acceptance curve (nothing is measured).")
    p.add_argument("--hardware", required=True, metavar="FILE",
                   help="a hardware profile: a file, or a reference name such as rtx4090 (see profiles/)")
    p.add_argument("--target-params", required=True, metavar="N", help="target size, e.g. 70B")
    p.add_argument("--quant", choices=["none", "int8", "int4", "q4_k_m", "nf4"], default="none",
                   help="the target's weights as streamed: none (16-bit, the default), int8 (ggml Q8_0), int4 "
                        "(ggml Q4_1), q4_k_m (a Q4_K_M GGUF), nf4 (bitsandbytes)")
    p.add_argument("--draft-params", default="1B", metavar="N", help="draft size (default 1B), resident in 16-bit; "
                   "`self` (or self:Q2_K): the target's own Q3_K (Q2_K) copy, as --draft self builds it")
    p.add_argument("--acceptance", metavar="FILE", help="a measured profile or acceptance file (default: the "
                   "acceptance prior shipped with offspec, measured with the default pair, or with the default "
                   "target's own copy for a self draft)")
    p.add_argument("--ram", metavar="SIZE", help="host RAM (default: the hardware profile's)")
    p.add_argument("--context", type=int, default=4096, help="context tokens the KV cache holds (default 4096)")
    p.add_argument("--out", metavar="PNG", help="write the plot here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _cmd_plan(args: argparse.Namespace) -> int:
    path = resolve_reference(args.hardware)
    hw_profile = load_profile(path)
    self_type = self_draft_type(args.draft_params)  # None: a draft model of --draft-params parameters
    if args.acceptance:
        acceptance, source = load_acceptance(Path(args.acceptance))
    else:
        acceptance, source = prior_acceptance(pair="self" if self_type is not None else "default")
        source += " (an assumption: a bigger pair accepts differently; pass --acceptance with a measured profile)"
    if args.context <= 0:
        raise OffspecError(f"--context must be positive, got {args.context}")
    target_params = parse_params(args.target_params)
    result = project(hw_profile["hardware"], target_params, args.quant,
                     target_params if self_type is not None else parse_params(args.draft_params), acceptance, source,
                     source=str(path), ram_bytes=parse_bytes(args.ram) if args.ram else None,
                     assume=replace(Assumptions(), context=args.context), self_type=self_type)
    name = hw_profile["name"]
    draft = f"its own {self_type} copy as the" if self_type is not None else args.draft_params
    title = f"{args.target_params} target ({args.quant}) + {draft} draft on {name}"
    plot = report.plot(result.plan, Path(args.out), title, projection=True) if args.out else None
    if args.json:
        print(json.dumps({"projection": True, "hardware": str(path), "plan": result.plan.summary(),
                          "curve": [p.as_dict() for p in result.plan.curve], "placement": result.placement,
                          "assumptions": list(result.assumptions), "plot": str(plot) if plot else None}))
        return 0
    pl = result.placement
    print(f"PROJECTION (computed from documented figures, not measured): {title}")
    print(f"hardware profile: {path}; its figures come from:")
    for line in hw_profile["sources"]:
        print(f"  - {line}")
    print(f"placement: {pl['target_bytes'] / 1e9:.1f} GB of target weights: {pl['device_bytes'] / 1e9:.1f} GB on the "
          f"device, {pl['ram_bytes'] / 1e9:.1f} GB streamed from RAM, {pl['ssd_bytes'] / 1e9:.1f} GB from SSD; "
          f"streaming {pl['stream_seconds_per_pass']:.2f} s per pass")
    print("\n" + report.plan_table(result.plan))
    print("\n" + report.plan_summary(result.plan, label="projected"))
    print("assumptions:")
    for line in result.assumptions:
        print(f"  - {line}")
    if plot:
        print(f"written: {plot}")
    return 0


def plan_main(argv: Optional[list[str]] = None) -> int:
    return _run(_cmd_plan, plan_parser().parse_args(argv))
