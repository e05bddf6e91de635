"""The CUDA paths of the streamer and the clocks, on a machine without CUDA: torch.cuda's streams and events are
replaced by fakes that record what they were asked (tests/test_cuda.py runs the real thing where CUDA exists).

- copy events are blocking (the reader thread sleeps instead of spinning a core);
- the engine's and the profiler's clocks wait for the compute stream only, never the whole device;
- a slot's first fill waits for the compute queued before the ring was allocated; `close()` drains the copy
  stream before the buffers go; with a copy engine that runs copies late, every layer still arrives intact.
"""

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from offspec.offload.diskio import aligned_empty
from offspec.offload.streamer import LayerSource, LayerStreamer
from offspec.offload.streams import DONE, Event, Streams
from offspec.store.packed import HEADER, build_store, plan_layer, tensor_views

CUDA1 = torch.device("cuda", 1)


class FakeCudaStream:
    def __init__(self, device=None, name="stream"):
        self.device, self.name, self.log = device, name, []

    def wait_event(self, event):
        self.log.append(("wait", event))

    def synchronize(self):
        self.log.append(("synchronize",))


class FakeCudaEvent:
    created = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing, self.blocking, self.stream = enable_timing, blocking, None
        FakeCudaEvent.created.append(self)

    def record(self, stream=None):
        self.stream = stream

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda streams/events as recording fakes; a device-wide synchronize fails the test."""
    compute = FakeCudaStream(name="compute")
    state = {"compute": compute, "set_device": []}
    FakeCudaEvent.created = []

    def device_wide(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize waits for every stream, the copy stream too")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeCudaStream(device, "copy"))
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state["set_device"].append(d))
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    return state


def test_copies_run_on_the_copy_stream_after_the_slot_is_free_with_blocking_events(fake_cuda):
    streams = Streams(CUDA1)
    after = streams.compute_done()  # e.g. the layer that last used the slot
    assert after.cuda.blocking and after.cuda.stream is fake_cuda["compute"]
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    done = streams.copy(dst, src, after)
    assert torch.equal(dst, src)  # (a CPU tensor copy stands in for the DMA)
    assert streams.copy_stream.log == [("wait", after.cuda)]  # ordered after the slot's last compute, GPU-side
    assert done.cuda.blocking and done.cuda.stream is streams.copy_stream  # the reader waits on it: sleep, not spin
    streams.compute_wait(done)
    assert ("wait", done.cuda) in fake_cuda["compute"].log
    streams.bind_thread()
    assert fake_cuda["set_device"] == [CUDA1]  # background threads use cuda:1, not GPU 0
    streams.drain_copies()
    assert streams.copy_stream.log[-1] == ("synchronize",) and ("synchronize",) not in fake_cuda["compute"].log


def test_the_engine_and_profiler_clocks_wait_for_the_compute_stream_only(fake_cuda):
    from offspec.profile.timing import timed
    from offspec.spec.engine import _clock

    _clock(CUDA1)
    assert fake_cuda["compute"].log == [("synchronize",)]
    timed(lambda: None, CUDA1)
    assert fake_cuda["compute"].log == [("synchronize",)] * 3


# --- the streamer against a copy engine that runs copies late ---------------------------------------
class LateEvent(Event):
    """The event of a copy that has not necessarily run yet: waiting for it runs every copy queued up to it."""

    def __init__(self, streams, serial):
        super().__init__(None)
        self.streams, self.serial = streams, serial

    def synchronize(self):
        self.streams.run_until(self.serial)


class LateStreams(Streams):
    """Copies are queued and run only when something waits for them (compute, the reader, a drain), as a GPU
    may run them late. Compute is synchronous (CPU). Records the order of allocations, events and copies."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.reads_into_slots = False  # the CUDA way: staging buffers, then (late) copies into the slots
        self.lock = threading.Lock()
        self.queue, self.serial, self.log = [], 0, []

    def empty(self, nbytes):
        self.log.append("allocate")
        return super().empty(nbytes)

    def compute_done(self):
        event = Event(None)
        self.log.append(("compute_done", event))
        return event

    def copy(self, dst, src, after):
        with self.lock:
            self.serial += 1
            self.queue.append((self.serial, dst, src))
            self.log.append(("copy", dst.data_ptr(), after))
            return LateEvent(self, self.serial)

    def run_until(self, serial):
        with self.lock:
            while self.queue and self.queue[0][0] <= serial:
                _, dst, src = self.queue.pop(0)
                dst.copy_(src)

    def compute_wait(self, event):
        if isinstance(event, LateEvent):
            event.synchronize()

    def drain_copies(self):
        self.run_until(float("inf"))

    def drain(self):
        self.drain_copies()


def _fake_layer(i):
    return {"w": torch.arange(4000, dtype=torch.float32) * (i + 1), "b": torch.full((7,), i, dtype=torch.int8)}


def test_streaming_with_late_copies_keeps_every_layer_intact_and_close_drains_them(tmp_path):
    n = 6
    plans = [plan_layer(i, [(k, v.dtype, tuple(v.shape)) for k, v in _fake_layer(i).items()]) for i in range(n)]
    packed = build_store(tmp_path / "s", {}, plans, lambda i: _fake_layer(i).items(), lambda e: None, "p", "p")
    sources = []
    for i in range(n):
        spec = packed.layers[i]
        if i % 3 == 1:  # RAM tier: a host copy
            buf = aligned_empty(spec.file_bytes)
            buf[: spec.file_bytes].copy_(torch.frombuffer(bytearray(packed.path(i).read_bytes()), dtype=torch.uint8))
            sources.append(LayerSource(i, spec, ram=buf[HEADER : HEADER + spec.nbytes]))
        else:  # SSD tier: read ahead into 2 staging buffers that the late copies read from
            sources.append(LayerSource(i, spec, path=packed.path(i)))
    ram_storage = weakref.ref(sources[1].ram.untyped_storage())
    streams = LateStreams()
    streamer = LayerStreamer(torch.device("cpu"), sources, ring_slots=2, staging_buffers=2, set_id=packed.set_id,
                             streams=streams)
    del sources, buf
    allocations = streams.log.index(("compute_done", streamer._p.allocated))
    assert streams.log[:allocations] == ["allocate", "allocate"]  # the ring first, then the event its fills wait for
    for _ in range(3):
        for i in range(n):
            views = tensor_views(streamer.acquire(i), packed.layers[i])
            assert torch.equal(views["w"], _fake_layer(i)["w"]) and torch.equal(views["b"], _fake_layer(i)["b"])
            streamer.release(i)
    copies = [entry for entry in streams.log if entry[0] == "copy"]
    first_fills = {}
    for _, slot, after in copies:
        first_fills.setdefault(slot, after)
    assert len(first_fills) == 2 and all(a is streamer._p.allocated for a in first_fills.values())
    p = streamer._p
    with p.cv:  # the copier fills the ring ahead: the next pass's first two layers
        while p.issued < p.released + p.n:
            p.cv.wait()
    assert streams.queue  # their copies are queued, not yet run, when the pass ends (layer 1's at least)
    threads = list(streamer._p.threads)
    streamer.close()
    assert streams.queue == [] and not any(t.is_alive() for t in threads)  # drained before the buffers went
    assert streamer.closed and streamer._p.slots == [] and streamer._p.staging == []
    gc.collect()
    assert ram_storage() is None  # the RAM-tier copy is released (on CUDA: unpinned) by close, not at exit
    with pytest.raises(Exception, match="closed"):
        streamer.acquire(0)


def test_done_is_complete():
    assert DONE.query() and DONE.cuda is None
