"""A CLI process skips the interpreter's last collection (about a second of walking torch's and transformers'
objects): `errors._quick_exit`, registered by `run_cli`, freezes what is left, except with Triton loaded (its
nanobind bindings would report the uncollected objects as leaks)."""

import gc
import subprocess
import sys

from offspec import errors


def test_what_is_left_at_exit_is_frozen_unless_triton_is_loaded(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", object())
    before = gc.get_freeze_count()
    errors._quick_exit()
    assert gc.get_freeze_count() == before
    monkeypatch.delitem(sys.modules, "triton")
    try:
        errors._quick_exit()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()  # this test process goes on: its objects back to the collector


def test_after_commands_the_other_exit_handlers_still_run_and_buffered_output_comes_out():
    code = ("import atexit, sys\nfrom offspec.errors import run_cli\n"
            "atexit.register(lambda: print('late handler ran', flush=True))\n"
            "print(run_cli(lambda: 0), run_cli(lambda: 3), flush=True)\n"
            "sys.stdout.write('unflushed tail')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0 3\nunflushed taillate handler ran\n"
