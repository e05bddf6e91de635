"""Shared fixtures. Tiny random models are saved as safetensors and loaded through the real code path."""

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers/tiny.py, tests/helpers/fakes.py
sys.path.insert(0, str(Path(__file__).parent.parent))  # the repo root: offspec/, tui/

from helpers.tiny import save_tiny_model  # noqa: E402

from offspec.util.paths import kernels_dir  # noqa: E402

# The CPU kernels compile once (about a minute) into the kernels dir; tests and their subprocesses that use a
# fresh OFFSPEC_CACHE_DIR would each compile them again. They share the user's kernels dir instead.
os.environ.setdefault("OFFSPEC_KERNELS_DIR", str(kernels_dir()))

# A CPU's --device-mem also holds the runtime's own memory, measured once per process
# (offspec.offload.hostmem.runtime_bytes): in this test process that is whatever earlier tests left (gigabytes), and
# from process to process it differs by megabytes, which would swamp the kilobyte budgets the tiny models are placed
# under (and the budgets one process suggests for another). Tests, and the commands they start, charge none;
# tests/test_streamed_head.py checks that the measured runtime is charged.
os.environ["OFFSPEC_RUNTIME_MEM"] = "0"

# A suite started in the background (`nohup ... &`, some CI runners) runs with SIGINT ignored, and the commands the
# tests start would inherit that: the tests that press Ctrl-C on them would see nothing happen. A handler set here
# is reset to the default in every child at exec, so their Ctrl-C works as a user's does.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny (target, draft) directories per architecture: the draft is the target plus noise."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for arch in ("llama", "qwen2"):
        for seed in (0, 1):
            target = save_tiny_model(root / f"{arch}-{seed}-target", arch=arch, seed=seed, logit_scale=3.0)
            draft = save_tiny_model(root / f"{arch}-{seed}-draft", arch=arch, seed=seed, logit_scale=3.0, noise=0.02)
            dirs[(arch, seed)] = (target, draft)
    return dirs


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs):
    """A loaded float64 generator on the tiny llama pair (float64 keeps batched == sequential exactly)."""
    import offspec

    target, draft = tiny_dirs[("llama", 0)]
    return offspec.load(str(target), str(draft), dtype="float64", max_context=256, max_budget=512)



def pytest_collection_modifyitems(config, items):
    """Real-pair tests (`integration`) take minutes: they are `slow` too, out of the quick lane (`-m "not slow"`)."""
    for item in items:
        if item.get_closest_marker("integration") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
