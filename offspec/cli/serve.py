"""`offspec serve`: an OpenAI-compatible HTTP server on the same models and options as `chat` and `generate`.

    offspec serve [--target X] [--draft Y] [--budget N|auto] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Errors a user can fix are one `error:` line on stderr (exit 2), checked before the models load where they
can be; Ctrl-C cancels the work in flight after its current pass and exits 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import offspec
from offspec.errors import run_cli
from offspec.serve.app import create_app
from offspec.serve.config import REASONING_FORMATS, ServeConfig
from offspec.serve.server import Server, address, bind

from .args import add_model_args, load_options
from .progress import TqdmProgress

_SERVE = ServeConfig()


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offspec serve", description="Serve the models over the OpenAI HTTP API "
                                "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    add_model_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=_SERVE.host, help=f"address to listen on (default {_SERVE.host}); a "
                   "non-loopback address needs --api-key or --insecure")
    s.add_argument("--port", type=int, default=_SERVE.port, help=f"port (default {_SERVE.port}; 0 = any free port)")
    s.add_argument("--api-key", metavar="KEY", default=os.environ.get("OFFSPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $OFFSPEC_API_KEY, else none)")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.add_argument("--queue-size", type=int, default=_SERVE.max_waiting, dest="max_waiting", metavar="N",
                   help=f"requests that may wait behind the running one; more get 429 (default {_SERVE.max_waiting})")
    s.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: the target's name)")
    s.add_argument("--reasoning-format", choices=REASONING_FORMATS, default=_SERVE.reasoning_format,
                   help="a reasoning model's reasoning (Qwen3's <think>, gpt-oss's analysis channel): deepseek, apart "
                        "in reasoning_content; none, left in content as written; a request's reasoning_format "
                        f"chooses too (default {_SERVE.reasoning_format})")
    return p


def serve_main(argv: list[str]) -> int:
    return run_cli(lambda: _serve(serve_parser().parse_args(argv)), interrupted="interrupted; the server stopped")


def _serve(args: argparse.Namespace) -> int:

    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key, insecure=args.insecure,
                         max_waiting=args.max_waiting, model_name=args.model_name,
                         reasoning_format=args.reasoning_format).validate()
    sock = bind(config.host, config.port)  # before loading: a port in use is known at once
    try:
        generator = offspec.load(progress=TqdmProgress(), **load_options(args))
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
        logging.getLogger("offspec.serve").setLevel(logging.INFO)  # one JSON line per request
        app = create_app(generator, config)
        sock.listen(128)
        model = config.model_name or generator.info.target
        key = "API key required" if config.api_key else "no API key"
        print(f"offspec serve: {model} at {address(sock)}/v1 ({key}; Ctrl-C stops)", file=sys.stderr, flush=True)
        Server(app, config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
