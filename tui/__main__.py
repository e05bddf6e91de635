"""`python -m tui`: try the chat UI on a scripted fake generator (no models needed)."""

from __future__ import annotations

import sys

from offspec.errors import OffspecError
from offspec.util import paths

from .app import ChatApp, require_terminal
from .fake import FakeGenerator, fake_factory


def main() -> int:
    require_terminal()
    generator = FakeGenerator(pass_seconds=0.08)
    factory = fake_factory(generator, steps=("assemble", "load", "warmup"), step_seconds=0.6)
    app = ChatApp(factory, data_dir=paths.data_dir() / "demo")  # demo chats stay apart from real ones
    app.run()
    return app.return_code or 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OffspecError as error:  # one line, no traceback
        sys.stderr.write(f"python -m tui: {error}\n")
        sys.exit(2)
