"""A local HTTP server standing in for the Hugging Face Hub (point HF_ENDPOINT at `FakeHub.url`).

It answers what huggingface_hub's `hf_hub_download` asks for a file stored with LFS, as the Hub does:

* `HEAD /{repo}/resolve/{revision}/{filename}`: 302 to a CDN address, with `X-Repo-Commit` (the revision),
  `X-Linked-Etag` (the file's sha256, quoted), `X-Linked-Size`, a git `ETag` and `Location`. The CDN address is on
  another host name (`localhost` for an endpoint on `127.0.0.1`), so the client stops at the redirect and reads the
  metadata from it, as it does for the Hub's real CDN;
* `GET` of the same address: the same redirect;
* `GET /cdn/{token}`: the bytes, with `Content-Length` (and `Range: bytes=N-` answered with 206);
* anything else: 404 with `X-Error-Code: EntryNotFound` (or `RevisionNotFound` for a known repo and file at an
  unknown revision).

`requests` records (method, path) of every request. `closed_port_url()` gives an address where nothing listens,
`silent_url()` one that accepts connections and never answers.
"""

from __future__ import annotations

import _thread
import hashlib
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional
from urllib.parse import unquote


@dataclass
class HubFile:
    data: bytes
    announced_sha256: str  # what the Hub says the file's sha256 is (X-Linked-Etag)
    announced_size: int  # X-Linked-Size
    interrupt_at: Optional[int] = None  # press Ctrl-C (in the main thread) after sending this many bytes


class FakeHub:
    def __init__(self) -> None:
        self.files: dict[tuple[str, str, str], HubFile] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, repo: str, revision: str, filename: str, data: bytes, *, announced_sha256: Optional[str] = None,
            announced_size: Optional[int] = None, interrupt_at: Optional[int] = None) -> None:
        """Serve `data` as `filename` of `repo` at `revision`; the announced sha256 and size default to the data's."""
        self.files[(repo, revision, filename)] = HubFile(
            data, announced_sha256 or hashlib.sha256(data).hexdigest(),
            len(data) if announced_size is None else announced_size, interrupt_at)

    def paths(self, method: Optional[str] = None) -> list[str]:
        with self._lock:
            return [path for m, path in self.requests if method is None or m == method]

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _find(self, path: str) -> tuple[Optional[HubFile], Optional[str], str]:
        """(file, cdn token, error code) for a /{repo}/resolve/{revision}/{filename} path."""
        parts = unquote(path.split("?", 1)[0]).lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return None, None, "EntryNotFound"
        repo, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        key = (repo, revision, filename)
        if key in self.files:
            return self.files[key], "-".join(key).replace("/", "_"), ""
        known = any(r == repo and f == filename for r, _, f in self.files)
        return None, None, "RevisionNotFound" if known else "EntryNotFound"

    def _by_token(self, token: str) -> Optional[HubFile]:
        for key, file in self.files.items():
            if "-".join(key).replace("/", "_") == token:
                return file
        return None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _empty(self, status: int, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in {**headers, "Content-Length": "0"}.items():
                    self.send_header(name, value)
                self.end_headers()

            def _resolve(self) -> None:
                file, token, error = hub._find(self.path)
                if file is None:
                    self._empty(404, {"X-Error-Code": error, "X-Error-Message": f"{error} (fake hub)"})
                    return
                revision = unquote(self.path).lstrip("/").split("/")[3]
                host = "localhost"  # another host than the endpoint's 127.0.0.1: the "CDN"
                self._empty(302, {
                    "Location": f"http://{host}:{hub.port}/cdn/{token}",
                    "X-Repo-Commit": revision,
                    "X-Linked-Etag": f'"{file.announced_sha256}"',
                    "X-Linked-Size": str(file.announced_size),
                    "ETag": f'"{hashlib.sha1(file.data).hexdigest()}"',  # the git pointer's id, as on the Hub
                })

            def _cdn(self, head: bool) -> None:
                file = hub._by_token(self.path[len("/cdn/"):])
                if file is None:
                    self._empty(404, {})
                    return
                start = 0
                ranged = self.headers.get("Range", "")
                if ranged.startswith("bytes=") and ranged[6:].split("-")[0].isdigit():
                    start = int(ranged[6:].split("-")[0])
                body = file.data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/octet-stream")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(file.data) - 1}/{len(file.data)}")
                self.end_headers()
                if head:
                    return
                if file.interrupt_at is None:
                    self.wfile.write(body)
                    return
                self._interrupted(body, file.interrupt_at)

            def _interrupted(self, body: bytes, at: int) -> None:
                """Send `at` bytes, press Ctrl-C in the main thread (the client), send one more byte so that its
                read returns and the interrupt is raised there, then wait for the client to hang up."""
                self.wfile.write(body[:at])
                self.wfile.flush()
                _thread.interrupt_main()
                try:
                    self.wfile.write(body[at:at + 1])
                    self.wfile.flush()
                    self.connection.settimeout(30)  # a safety net only: the client closes at once
                    while self.connection.recv(1 << 16):
                        pass
                except OSError:
                    pass
                self.close_connection = True

            def do_HEAD(self) -> None:
                with hub._lock:
                    hub.requests.append(("HEAD", self.path))
                self._cdn(head=True) if self.path.startswith("/cdn/") else self._resolve()

            def do_GET(self) -> None:
                with hub._lock:
                    hub.requests.append(("GET", self.path))
                self._cdn(head=False) if self.path.startswith("/cdn/") else self._resolve()

        return Handler


@contextmanager
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    try:
        yield hub
    finally:
        hub.stop()


def closed_port_url() -> str:
    """An address on this machine where nothing listens (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def silent_url() -> Iterator[str]:
    """An address that accepts connections (the kernel completes the handshake) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
