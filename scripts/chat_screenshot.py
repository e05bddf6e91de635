"""Record a real multi-turn conversation in the chat app (headless) and save an SVG screenshot.

    python scripts/chat_screenshot.py --out docs/chat.svg [--budget 16] [model flags of `offspec chat`]

It drives the real app (Textual Pilot) on the real engine: loading screen, then each prompt is typed and
sent, the reply streams, and the next prompt waits for it. The history goes to a temp data dir.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from textual.widgets import Input  # noqa: E402

from offspec.cli.args import add_model_args, load_options  # noqa: E402
from tui.app import ChatApp, engine_factory  # noqa: E402
from tui.settings import ChatSettings  # noqa: E402

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number, iteratively.",
           "Now add type hints and a docstring."]


async def record(args: argparse.Namespace) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="offspec-shot-"))
    app = ChatApp(engine_factory(load_options(args)), data_dir=data_dir)
    async with app.run_test(size=(args.width, args.height)) as pilot:
        async def wait(predicate, what: str, timeout: float = 1800.0) -> None:
            deadline = time.monotonic() + timeout
            while not predicate():
                if time.monotonic() > deadline:
                    raise SystemExit(f"timed out waiting for {what}")
                await pilot.pause(0.2)

        await wait(lambda: app.chat_screen is not None and app.screen is app.chat_screen, "the models to load")
        screen = app.chat_screen
        screen.session.update_settings(ChatSettings(temperature=0.0, max_new_tokens=args.max_new_tokens,
                                                    budget=args.budget))
        await pilot.press("ctrl+t")  # the tree panel
        for prompt in args.prompt or PROMPTS:
            screen.query_one("#prompt", Input).value = prompt
            await pilot.press("enter")
            await wait(lambda: screen.reply is None, "the reply")
        await pilot.pause(0.5)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--out", default="docs/chat.svg")
    parser.add_argument("--prompt", action="append", help="a user turn (repeatable); default: two coding turns")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--width", type=int, default=150)
    parser.add_argument("--height", type=int, default=48)
    args = parser.parse_args()
    asyncio.run(record(args))


if __name__ == "__main__":
    main()
