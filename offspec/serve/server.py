"""Running the app: a listening socket and a uvicorn server whose Ctrl-C also cancels the engine's work.

On Ctrl-C (or SIGTERM) uvicorn stops accepting connections and waits for the open ones; `Server` also
refuses the waiting requests (503) and cancels the running generation, which ends after its current pass,
so the wait is one pass long. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import FastAPI

from offspec.errors import OffspecError

from .config import ServeConfig


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one), not yet listening: until `listen()`, connections
    are refused rather than left waiting while the models load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OffspecError(f"cannot use host {host!r} ({exc.strerror}); pass an address like 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OffspecError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
    return sock


def address(sock: socket.socket) -> str:
    """http://host:port of a bound socket (the real port when 0 was asked for)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server; its exit signal also shuts the app's engine down (from a thread of its own: a
    signal handler must not wait for the engine's lock)."""

    def __init__(self, app: FastAPI, config: ServeConfig):
        super().__init__(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                        timeout_graceful_shutdown=int(config.shutdown_grace_seconds) + 5))
        self.engine = app.state.engine

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        threading.Thread(target=self.engine.shutdown, name="offspec-shutdown", daemon=True).start()
