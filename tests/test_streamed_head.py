"""The LM head streamed from SSD in row chunks (offspec/offload/head.py) and where the placement chooses it.

Tier 1: random ggml blocks in a scratch file (exact expectations: bitwise the resident head's logits, the bytes
read per call, damage found); the placement's choice on made-up sizes. Tier 2: a tiny GGUF pair loaded with the
head streamed generates exactly what it generates with the head resident."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny_gguf import random_blocks, save_tiny_gguf

import offspec
from offspec import OffspecError
from offspec.formats.ggml import KERNEL_TYPES
from offspec.formats.modules import QLinear
from offspec.offload.config import OffloadConfig
from offspec.offload.diskio import FileReader
from offspec.offload.head import StreamedHead, chunk_crcs, chunk_rows
from offspec.offload.placement import ModelSizes, plan_placement

CPU = torch.device("cpu")
Q6_K = next(i for i, t in KERNEL_TYPES.items() if t.name == "Q6_K")


def test_chunks_are_whole_runs_of_4k_pages():
    assert chunk_rows(1260, 151_936, 8 * 2**20) % 1024 == 0  # Q6_K at 1536 columns: 1024 rows = 315 pages
    assert chunk_rows(1260, 151_936, 8 * 2**20) * 1260 <= 8 * 2**20
    assert chunk_rows(1260, 500, 8 * 2**20) == 500  # a small head is one chunk
    assert chunk_rows(1260, 151_936, 1) == 1024  # never less than one aligned run


def _head_file(tmp_path: Path, rows: int, cols: int, skew: int, seed: int = 0) -> tuple[Path, np.ndarray, int]:
    """A file holding Q6_K rows at `4096 + skew` (a payload's tensor need not start on a page)."""
    blocks = random_blocks(np.random.default_rng(seed), "Q6_K", rows, cols)  # (rows, row_bytes) uint8
    path = tmp_path / "other.bin"
    offset = 4096 + skew
    data = bytearray(offset) + blocks.tobytes()
    data += bytearray(-len(data) % 4096)  # padded to whole pages, as the store's files are
    path.write_bytes(bytes(data))
    return path, blocks, offset


def _streamed(path: Path, blocks: np.ndarray, offset: int, cols: int, target: int, verify: str = "first",
              on_corrupt=lambda: "rebuild it") -> tuple[QLinear, StreamedHead]:
    rows = blocks.shape[0]
    resident = QLinear(Q6_K, cols, rows, bias=False, device=CPU)
    resident.qweight = torch.from_numpy(blocks.copy())
    crcs, _ = chunk_crcs(path, offset, blocks.shape[1], rows, target=target)
    return resident, StreamedHead(resident, path, offset, FileReader(), crcs, verify, on_corrupt, target_bytes=target)


@pytest.mark.parametrize("skew", [0, 1792])
def test_streamed_logits_are_bitwise_the_resident_heads(tmp_path, skew):
    cols, rows = 512, 2600  # Q6_K: 420 B/row; 4096/gcd(420, 4096) = 1024 rows per aligned run
    path, blocks, offset = _head_file(tmp_path, rows, cols, skew)
    resident, head = _streamed(path, blocks, offset, cols, target=420 * 1024)
    assert [b - a for a, b in head.bounds] == [1024, 1024, 552]  # the last chunk is partial
    torch.manual_seed(0)
    for n in (1, 5, 33, 1, 64):  # alternating directions from call to call
        x = torch.randn(n, cols)
        assert torch.equal(head(x), resident(x)), n
    x = torch.randn(2, 3, cols)  # leading dimensions kept
    assert torch.equal(head(x), resident(x))


def test_each_call_reads_all_but_the_two_chunks_it_starts_with(tmp_path):
    cols, rows = 512, 5 * 1024
    path, blocks, offset = _head_file(tmp_path, rows, cols, 0)
    _, head = _streamed(path, blocks, offset, cols, target=420 * 1024)
    chunk = 1024 * 420
    x = torch.randn(3, cols)
    head(x)
    assert head.counters()[0] == 5 * chunk  # the first call reads everything
    head(x)
    assert head.counters()[0] == (5 + 3) * chunk  # then the two chunks the last call ended on are still there
    head(x)
    assert head.counters()[0] == (5 + 6) * chunk
    head.close()


def test_a_damaged_chunk_is_one_line_and_marks_the_store(tmp_path):
    cols, rows = 512, 3 * 1024
    path, blocks, offset = _head_file(tmp_path, rows, cols, 0)
    marked = []
    _, head = _streamed(path, blocks, offset, cols, target=420 * 1024,
                        on_corrupt=lambda: marked.append(1) or "the set will be rebuilt on the next start")
    with open(path, "r+b") as f:  # the second chunk changes on disk after the load checked it
        f.seek(offset + 1024 * 420 + 10)
        f.write(b"\xff\xff")
    with pytest.raises(OffspecError) as info:
        head(torch.randn(1, cols))
    assert "\n" not in str(info.value) and re.search(r"LM head .* corrupt .*rows 1024-2048.*rebuilt", str(info.value))
    assert marked == [1]


def test_first_verifies_once_and_always_every_read(tmp_path):
    cols, rows = 512, 3 * 1024
    path, blocks, offset = _head_file(tmp_path, rows, cols, 0)
    x = torch.randn(1, cols)
    _, first = _streamed(path, blocks, offset, cols, target=420 * 1024, verify="first")
    _, always = _streamed(path, blocks, offset, cols, target=420 * 1024, verify="always")
    first(x), always(x)  # every chunk read and checked once
    with open(path, "r+b") as f:  # the first chunk changes; the second call (walking back) reads it last
        f.seek(offset + 7)
        f.write(b"\xee")
    for _ in range(2):
        first(x)  # checked once already: not again
    with pytest.raises(OffspecError, match="corrupt"):
        always(x)


def test_a_failed_read_leaves_the_head_usable(tmp_path, monkeypatch):
    cols, rows = 512, 3 * 1024
    path, blocks, offset = _head_file(tmp_path, rows, cols, 0)
    resident, head = _streamed(path, blocks, offset, cols, target=420 * 1024)
    x = torch.randn(2, cols)
    real = head.reader.read
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(head.reader, "read", flaky)
    with pytest.raises(OSError):
        head(x)
    assert torch.equal(head(x), resident(x))  # the next call starts over and gets every chunk


def test_the_store_checksum_covers_the_bytes_around_the_head(tmp_path):
    cols, rows = 512, 2048
    path, blocks, offset = _head_file(tmp_path, rows, cols, 256)
    before = path.read_bytes()[4096:offset]
    crcs, whole = chunk_crcs(path, offset, blocks.shape[1], rows, seed=zlib.crc32(before), target=420 * 1024)
    assert len(crcs) == 2
    assert whole == zlib.crc32(before + blocks.tobytes())


# --- placement --------------------------------------------------------------------------------------------

MB = 10**6


def _sizes(**kw) -> ModelSizes:
    base = dict(layer_bytes=(30 * MB,) * 28, file_bytes=30 * MB + 8192, other_bytes=192 * MB, kv_bytes=60 * MB,
                activation_bytes=30 * MB, extra_bytes=400 * MB, workspace_bytes=350 * MB, head_bytes=191 * MB,
                head_buffer_bytes=8 * MB)
    base.update(kw)
    return ModelSizes(**base)


def test_a_cpu_streams_the_head_only_where_it_does_not_fit_otherwise():
    roomy = plan_placement(_sizes(), CPU, OffloadConfig(device_mem=1500 * MB))
    assert not roomy.head_streamed and roomy.bytes_per_pass == roomy.bytes_in("ssd")
    tight = plan_placement(_sizes(), CPU, OffloadConfig(device_mem=1000 * MB))
    assert tight.head_streamed and tight.count("device") == 0
    assert tight.bytes_per_pass == tight.bytes_in("ssd") + 191 * MB
    assert tight.device_bytes <= 1000 * MB
    assert tight.resident_bytes == (192 - 191 + 16 + 60 + 30 + 400 + 350) * MB  # two read buffers, not the head
    assert "LM head from SSD" in tight.describe() and tight.summary()["head_streamed"]
    with pytest.raises(OffspecError, match="too small"):
        plan_placement(_sizes(), CPU, OffloadConfig(device_mem=1000 * MB, stream_head="never"))
    always = plan_placement(_sizes(), CPU, OffloadConfig(device_mem=1500 * MB, stream_head="always"))
    assert always.head_streamed and always.count("device") > roomy.count("device")  # its room holds layers
    tied = plan_placement(_sizes(head_bytes=0), CPU, OffloadConfig(device_mem=2000 * MB, stream_head="always"))
    assert not tied.head_streamed  # nothing to stream: a tied head is the memory-mapped token table


def test_the_head_never_streams_on_a_gpu():
    with pytest.raises(OffspecError, match="too small"):
        plan_placement(_sizes(), torch.device("cuda"), OffloadConfig(device_mem=700 * MB, ram_mem=0,
                                                                     stream_head="always"))


def test_bad_stream_head_is_one_line():
    with pytest.raises(OffspecError, match="stream_head must be auto, always or never"):
        OffloadConfig(stream_head="sometimes").validate()


# --- a tiny GGUF pair --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ggufs")
    target = save_tiny_gguf(root / "qwen2-target.gguf", "qwen2", seed=0, layers=6)
    draft = save_tiny_gguf(root / "qwen2-draft.gguf", "qwen2", seed=0, layers=6, noise=0.002)
    return str(target), str(draft)


@pytest.mark.slow
def test_a_streamed_head_generates_what_the_resident_one_does(pair, tmp_path, monkeypatch):
    from offspec.offload import head as head_module

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    # a tiny vocabulary fits one aligned run of rows: cut it finer (chunks at any row then, not page-aligned)
    monkeypatch.setattr(head_module, "chunk_rows", lambda row_bytes, rows, target=0: 37)
    load = dict(max_context=256, max_budget=64, offload_dir=str(tmp_path / "offload"))
    resident = offspec.load(*pair, **load)
    plain = resident.generate("Hello there", max_new_tokens=40, speculate=False)
    streamed = offspec.load(*pair, device_mem="64GB", stream_head="always", **load)
    head = streamed.engine.target.model.get_output_embeddings()
    assert isinstance(head, StreamedHead) and head.qweight.is_meta  # nothing of it kept between calls
    assert streamed.info.extra["placement"]["head_streamed"]
    assert streamed.generate("Hello there", max_new_tokens=40, speculate=False).token_ids == plain.token_ids
    for nodes in (1, 8, 64):
        result = streamed.generate("Hello there", max_new_tokens=40, budget=nodes)
        assert result.token_ids == plain.token_ids, nodes
    before = head.counters()[0]
    result = streamed.generate("Hi", max_new_tokens=8, speculate=False)
    assert sum(p.bytes_streamed for p in result.passes) == head.counters()[0] - before > 0  # the passes count them
    streamed.close()


def test_a_cpu_budget_holds_the_runtime_measured_once(pair, tmp_path, monkeypatch):
    """A CPU's --device-mem caps the whole process: the runtime's own memory (Python, torch, transformers, the
    tokenizer) is charged with the models, measured when the first model is placed and the same afterwards."""
    from offspec.formats import kernels
    from offspec.offload import hostmem
    from offspec.offload.config import WORKSPACE

    readings = iter([300 * MB, 900 * MB])
    monkeypatch.delenv("OFFSPEC_RUNTIME_MEM")  # set to 0 for the other tests (conftest.py)
    monkeypatch.setattr(hostmem, "_measured", [None])
    monkeypatch.setattr(hostmem, "measure_anonymous", lambda: next(readings))
    assert hostmem.runtime_bytes(exclude=20 * MB) == 280 * MB  # a draft held in memory is the draft's
    assert hostmem.runtime_bytes() == 280 * MB  # measured once
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    gen = offspec.load(*pair, max_context=256, max_budget=64, device_mem="64GB", offload_dir=str(tmp_path / "o"))
    sizes = gen.info.extra["placement"]["sizes"]
    decode = 0 if kernels.compiled() is not None else kernels.DECODE_WORKSPACE
    assert sizes["workspace_bytes"] == WORKSPACE["cpu"] + decode + 280 * MB
    monkeypatch.setenv("OFFSPEC_RUNTIME_MEM", "123MB")  # given instead of measured
    assert hostmem.runtime_bytes() == 123 * MB
    monkeypatch.setenv("OFFSPEC_RUNTIME_MEM", "lots")
    with pytest.raises(OffspecError, match="OFFSPEC_RUNTIME_MEM"):
        hostmem.runtime_bytes()


def test_a_closed_head_says_so(tmp_path):
    path, blocks, offset = _head_file(tmp_path, 1024, 512, 0)
    _, head = _streamed(path, blocks, offset, 512, target=420 * 1024)
    head.close()
    with pytest.raises(OffspecError, match="closed; load the model again"):
        head(torch.randn(1, 512))


def test_a_head_with_a_bias_keeps_it(tmp_path):
    cols, rows = 512, 2048
    path, blocks, offset = _head_file(tmp_path, rows, cols, 0)
    resident = QLinear(Q6_K, cols, rows, bias=True, device=CPU)
    resident.qweight = torch.from_numpy(blocks.copy())
    resident.bias = torch.randn(rows)
    crcs, _ = chunk_crcs(path, offset, blocks.shape[1], rows, target=420 * 1024)
    head = StreamedHead(resident, path, offset, FileReader(), crcs, target_bytes=420 * 1024)
    x = torch.randn(3, cols)
    assert torch.equal(head(x), resident(x))
