"""`offspec doctor`: check what offspec will do on this machine; one line per check, exit 1 if one fails."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from offspec.doctor import FAIL, PASS, SKIP, run_checks
from offspec.errors import run_cli
from offspec.util.device import resolve_device, resolve_dtype, use_device
from offspec.util.paths import cache_dir

from .progress import TqdmProgress


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec doctor", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: what offspec picks for the device)")
    p.add_argument("--target", help="model whose layer size the overlap check streams (default: the built-in "
                                    "target when it is set up, else a 70B-shaped layer)")
    p.add_argument("--offload-dir", metavar="DIR", help="where the SSD read is measured (default: where packed "
                                                       "layers go, <cache dir>/offload)")
    p.add_argument("--quick", action="store_true", help="smaller copies and reads (64 MiB instead of 256 MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:


    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    use_device(device)
    offload_dir = Path(args.offload_dir).expanduser() if args.offload_dir else cache_dir() / "offload"

    def started(name: str) -> None:
        print(f"checking {name} ...", file=sys.stderr, flush=True)

    def done(check) -> None:
        if not args.json:
            print(check.line(), flush=True)

    checks = run_checks(device, dtype, offload_dir, target=args.target, quick=args.quick, on_start=started,
                        on_done=done, progress=TqdmProgress())
    counts = {status: sum(c.status == status for c in checks) for status in (PASS, FAIL, SKIP)}
    if args.json:
        print(json.dumps({"device": str(device), "dtype": str(dtype).removeprefix("torch."), "counts": counts,
                          "checks": [vars(c) for c in checks]}, default=str))
    else:
        print(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped", flush=True)
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
