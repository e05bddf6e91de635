"""`offspec serve`: an OpenAI-compatible local HTTP server on the speculative engine.

Library side (no CLI imports): `create_app(generator, ServeConfig(...))` gives the FastAPI app;
`offspec.serve.server` binds and runs it. `offspec.cli.serve` is the sub-command.
"""

from .app import create_app
from .config import ServeConfig

__all__ = ["create_app", "ServeConfig"]
