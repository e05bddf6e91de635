"""A live `offspec serve` app on 127.0.0.1 (an ephemeral port), run by uvicorn in a thread, for tests."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from offspec.serve import ServeConfig, create_app
from offspec.serve.server import Server, address, bind


@contextlib.contextmanager
def live_server(generator, config: ServeConfig = ServeConfig()) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) while the server runs; stops it and its engine after."""
    app = create_app(generator, config)
    sock = bind("127.0.0.1", 0)
    sock.listen(128)
    server = Server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield address(sock)
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the test server did not stop"
        assert not app.state.engine._thread.is_alive(), "the engine worker did not stop"
