"""CUDA graphs' bookkeeping (offspec/formats/gpu/graphs.py) on a machine without CUDA: buckets and padding, capture
once per key and replay with the inputs copied in, and the torch.cuda calls of a capture (monkeypatched: recording
fakes). The real capture, and a replay equal to the eager call bit for bit: tests/test_cuda_layer.py."""

import contextlib
import importlib.util

import pytest
import torch
from helpers.gpu_layer_checks import FakeCapturer
from helpers.interpreted import interpret

from offspec.formats.gpu import graphs
from offspec.formats.gpu.attention import TailKeys
from offspec.formats.gpu.graphs import Graphs, bucket, pad_keys, pad_rows, run_bucketed


def rowwise(h, cos, sin, slots, prefix, gather, count):
    """A stand-in for a layer: each row from its own inputs (and the attention pattern's row)."""
    extra = (gather.sum(dim=1) + count + prefix).to(h.dtype)  # (rows,)
    return h * cos.sum(dim=1, keepdim=True) + sin + slots[:, None].to(h.dtype) + extra[:, None]


def keys_of(visible, prefix):
    return TailKeys.of(visible, prefix)


def test_buckets_and_padding():
    assert [bucket(n) for n in (1, 2, 3, 17, 64, 65, 1024)] == [1, 2, 4, 32, 64, 128, 1024]
    assert bucket(1025) is None and bucket(0) == 1
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(pad_rows(t, 3), t)
    assert torch.equal(pad_rows(t, 5), torch.tensor([[0, 1], [2, 3], [4, 5], [4, 5], [4, 5.0]]))
    visible = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)  # prefix 2
    keys = keys_of(visible, 2)
    assert keys.prefix.tolist() == [2] and keys.count.tolist() == [1, 2, 2]
    assert keys.gather.tolist() == [[2, 0, 0], [2, 3, 0], [3, 4, 0]]  # each row's visible tail slots, in order
    padded = pad_keys(keys, 4, 16)
    assert padded.gather.shape == (4, 16) and padded.count.tolist() == [1, 2, 2, 2]
    assert padded.gather[3, :2].tolist() == [3, 4] and padded.prefix is keys.prefix


def test_each_key_is_captured_once_and_replays_read_the_new_inputs():
    capturer = FakeCapturer()
    g = Graphs(capturer)
    add = lambda a, b: a + b  # noqa: E731
    x, y = torch.ones(3), torch.full((3,), 2.0)
    out = g("k", add, x, y)
    assert torch.equal(out, torch.full((3,), 3.0)) and g.captures == 1 and g.replays == 1
    static = g.entries["k"].inputs
    assert static[0] is not x and static[0].data_ptr() != x.data_ptr()  # the graph reads its own buffers
    out2 = g("k", add, torch.full((3,), 5.0), y)
    assert out2 is out and torch.equal(out2, torch.full((3,), 7.0)) and g.captures == 1 and g.replays == 2
    g("other", add, x, y)
    assert g.captures == 2
    with pytest.raises(ValueError, match="captured with"):
        g("k", add, torch.ones(4), torch.ones(4))


def test_bucketed_calls_give_the_unpadded_rows_and_run_eagerly_past_the_buckets():
    g = Graphs(FakeCapturer())
    torch.manual_seed(0)
    for n in (1, 3, 5, 3, 17):
        prefix = 7
        visible = torch.ones((n, prefix + n), dtype=torch.bool)
        visible[:, prefix:] = torch.rand((n, n)) < 0.5
        visible[:, prefix:] |= torch.eye(n, dtype=torch.bool)
        keys = keys_of(visible, prefix)
        h, cos, sin = torch.randn(n, 4), torch.randn(n, 8), torch.randn(n, 4)
        slots = torch.arange(prefix, prefix + n)
        got = run_bucketed(g, "draft", rowwise, h, cos, sin, slots, keys)
        want = rowwise(h, cos, sin, slots, keys.prefix, keys.gather, keys.count)
        assert torch.equal(got, want)
    assert set(g.entries) == {("draft", 1, 16), ("draft", 4, 16), ("draft", 8, 16), ("draft", 32, 64)}
    assert g.replays == 5
    big = 1025
    keys = keys_of(torch.ones((big, big), dtype=torch.bool), big - 1)
    out = run_bucketed(g, "draft", rowwise, torch.ones(big, 4), torch.ones(big, 8), torch.ones(big, 4),
                       torch.arange(big), keys)
    assert out.shape == (big, 4) and g.replays == 5  # eager
    assert run_bucketed(None, "x", rowwise, h, cos, sin, slots, keys_of(visible, prefix)).shape == h.shape


def test_a_cuda_capture_warms_up_on_a_side_stream_and_shares_one_pool(monkeypatch):
    log = []

    class Stream:
        def __init__(self, device=None, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    compute = Stream(name="compute")

    class CUDAGraph:
        def replay(self):
            log.append(("replay", id(self)))

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("capture", pool))
        yield

    @contextlib.contextmanager
    def stream(s):
        log.append(("on", s.name))
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: log.append(("pool",)) or "POOL")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    calls = []
    g = Graphs.on(torch.device("cuda", 0))

    def fn(a):
        calls.append(log[-1])
        return a * 2

    out = g("a", fn, torch.ones(2))
    assert log[:4] == [("pool",), ("wait", "side", "compute"), ("on", "side"), ("wait", "compute", "side")]
    assert log[4] == ("capture", "POOL") and log[5][0] == "replay"
    assert calls == [("on", "side"), ("capture", "POOL")]  # the warm-up on the side stream, then the capture
    g("b", fn, torch.ones(2))
    assert [e for e in log if e[0] == "pool"] == [("pool",)]  # one pool for all of them
    assert [e for e in log if e[0] == "capture"] == [("capture", "POOL")] * 2
    assert torch.equal(out, torch.full((2,), 2.0))


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@needs_triton
@pytest.mark.slow
def test_padded_rows_of_the_real_layer_leave_the_real_rows_and_the_cache_bits_as_they_are():
    """The CUDA layer in Triton's interpreter, through run_bucketed with a fake capturer: a 3-node tree padded to 4
    rows and a 5-node one padded to 8 give the bits of the unpadded calls, outputs and cache."""
    r = interpret("graphs", "float32")
    assert all(r["rows"]) and all(r["cache"]) and (r["captures"], r["replays"]) == (2, 3), r
    assert graphs.BUCKETS[0] == 1
