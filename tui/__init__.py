"""offspec chat: a Textual terminal chat on the offloaded speculative engine.

Entry point: `tui.app.run_chat(load_options, data_dir=None) -> int`.
"""

from __future__ import annotations

__all__ = ["run_chat", "ChatApp"]


def __getattr__(name: str):
    # Lazy, so that `import tui` stays cheap for a CLI that only sometimes runs the chat.
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
