"""A live `offspec serve` app on 127.0.0.1 (an ephemeral port), run by uvicorn in a thread, for tests."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from sse_starlette.sse import AppStatus

from offspec.serve import ServeConfig, create_app
from offspec.serve.server import Server, address, bind


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    server: Server


@contextlib.contextmanager
def live_server(generator, config: ServeConfig = ServeConfig()) -> Iterator[LiveServer]:
    """The server runs while the block does; after it, the server and its engine worker have stopped."""
    app = create_app(generator, config)
    sock = bind("127.0.0.1", 0)
    sock.listen(128)
    server = Server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the test server did not start")
    assert thread.is_alive(), "the test server stopped at start"
    try:
        yield LiveServer(address(sock), server)
    finally:
        server.should_exit = True
        thread.join(60)
        AppStatus.should_exit = False  # sse-starlette's process-wide flag, set by a test's handle_exit
        assert not thread.is_alive(), "the test server did not stop"
        assert not app.state.engine._thread.is_alive(), "the engine worker did not stop"


def wait_until(condition: Callable[[], bool], message: str, timeout: float = 30.0) -> None:
    """Poll a condition that another thread makes true (never a bare sleep-and-hope)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.005)


@contextlib.contextmanager
def cli_server(*args: str, timeout: float = 120.0) -> Iterator[tuple]:
    """`python main.py serve ARGS --port 0` in a subprocess. Yields (process, base URL, stderr lines so far)
    once it listens; kills it after the block if it is still running."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]  # the repo root
    proc = subprocess.Popen([sys.executable, str(root / "main.py"), "serve", *args, "--port", "0"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while not (seen and seen[-1].startswith("offspec serve:")):
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start:\n" + "".join(seen)
            seen.append(proc.stderr.readline())
        yield proc, re.search(r"at (http://127\.0\.0\.1:\d+)/v1", seen[-1]).group(1), seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
