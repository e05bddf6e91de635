"""offspec's Triton kernels compiled ahead of time on this CPU for sm_80, sm_86, sm_89 and sm_90 (Triton's compiler
and its bundled ptxas; offspec/formats/gpu/aot.py), the launches recorded from the real code (launch.recording):

- every kernel configuration fits each card's shared memory and registers (Triton's interpreter checks none: the
  H100 found `_gemm` needing 262,144 B of its 232,448). Quick: the largest linear tiles per card, the layer
  kernels on the smallest card; slow (a test per type and card: select by node id): every type at each card's
  largest tiles, every tiling and decode on the smallest card (the lattice and ternary types: fewer, see LARGEST),
  the layer kernels on every card (float16 has bfloat16's bytes: the same tiles);
- a linear's rows go through one arithmetic at every row count: the launches of 1, 17, 64 and 1,024 rows use the
  same operand layouts (MMA version, instruction shape, kWidth: the K order inside an instruction), the same PTX
  arithmetic, no contraction, mma.sync and never wgmma; the negative controls show the comparison sees what broke
  the H100's rows (kWidth 4 against 2, fused multiply-adds where contraction was on).

Compiled kernels are kept per process and in Triton's cache on disk (a warm run takes a few seconds).
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")

LATTICE = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")
ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS", "MXFP4") + LATTICE
CARDS_ = ("sm_80", "sm_86", "sm_89", "sm_90")
# The lattice and ternary types' decoders differ in their grid reads (an int8 table read through L1: no shared
# memory), not in the tiles and MMA that follow: their sweep is cut to what CI can afford (all of it cost 35 min of a
# busy 2-core machine, the cut below of stop 66 still ~10): bfloat16 at sm_90's largest tiles, both dtypes on the
# smallest card (sm_89: the least shared memory, the registers of every card from sm_80 on), every tiling there in
# bfloat16 and, for one type per decoder family, float32; one card's arithmetic.
FAMILIES = ("IQ1_M", "IQ2_S", "IQ3_S", "TQ1_0")  # the largest decoder of each family (sign tables, two grids, ...)
LARGEST = [(card, t, dtypes) for t in ALL_TYPES for card in CARDS_
           for dtypes in ([("bfloat16", "float32")] if t not in LATTICE else
                          [("bfloat16", "float32")] if card == "sm_89" else
                          [("bfloat16",)] if card == "sm_90" else [])]
TILINGS = [(dtype, t) for t in ALL_TYPES for dtype in ("bfloat16", "float32")
           if t not in LATTICE or dtype == "bfloat16" or t in FAMILIES]
ARITHMETIC = [(card, dtype, t) for card, dtype in (("sm_90", "bfloat16"), ("sm_80", "float32")) for t in ALL_TYPES
              if t not in LATTICE or card == "sm_90"]
ROW_COUNTS = (1, 17, 64, 1024)


def _linear_launches(type_name, dtype, rows, gpu, cols=1024, ntot=300, bias=True, group=1):
    """The launches `linear` makes for `rows` rows of a (ntot, cols) weight of `type_name` on `gpu` (nothing runs)."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl
    from offspec.formats.gpu.launch import recording

    t = ggml_type(type_name)
    weights = [(torch.zeros((ntot // group, t.row_bytes(cols)), dtype=torch.uint8), t.id) for _ in range(group)]
    x = torch.zeros((rows, cols), dtype=dtype)  # (rows, cols)
    b = torch.zeros(ntot // group * group, dtype=dtype) if bias else None
    with recording(gpu) as launches:
        gl.linear(x, weights, cols, b)
    return launches


def _grouped_launches(type_name, dtype, rows, gpu, cols=1024, n=300, parts=2, experts=8, bias=True):
    """The launches `grouped_linear` makes for `experts` routed experts of `rows` rows each, `parts` (n, cols)
    weights of `type_name` each (gate and up), on `gpu` (nothing runs)."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import experts as gx
    from offspec.formats.gpu.launch import recording

    t = ggml_type(type_name)
    ws = [[torch.zeros((n, t.row_bytes(cols)), dtype=torch.uint8) for _ in range(experts)] for _ in range(parts)]
    x = torch.zeros((rows * experts, cols), dtype=dtype)  # (R, cols)
    biases = [[torch.zeros(n) for _ in range(experts)] for _ in range(parts)] if bias else None
    with recording(gpu) as launches:
        gx.grouped_linear(x, [rows] * experts, ws, t.id, cols, biases)
    return launches


def _layer_launches(dtype, gpu, heads=32, kv_heads=8, head_dim=128, hidden=4096):
    from offspec.formats.gpu.launch import recording
    from offspec.formats.gpu.probe import LayerCase, _layer_kernels

    with recording(gpu) as launches:
        _layer_kernels(LayerCase(hidden, heads, kv_heads, head_dim), torch.device("cpu"), dtype)
    return launches


def _check_resources(launches, gpu):
    from offspec.formats.gpu import aot

    for launch in launches:
        kernel = aot.compile_launch(launch, gpu)
        used = aot.resources(kernel)
        assert used.registers is not None, "no cuobjdump to read the registers with (Triton's wheel bundles one)"
        constants = {k: v for k, v in launch.kwargs.items() if k.isupper() or k.startswith("num_")}
        assert not used.problems(gpu), (gpu.name, launch.kernel.fn.__name__, constants, used)


def _arithmetic(launches, gpu):
    """What rows go through in these launches together: the union of their kernels' arithmetic."""
    from offspec.formats.gpu import aot

    dots, instructions = set(), set()
    for launch in launches:
        a = aot.arithmetic(aot.compile_launch(launch, gpu))
        dots |= set(a.dots)
        instructions |= a.instructions
        assert not aot.contractible(a), (launch.kernel.fn.__name__, aot.contractible(a))
    return aot.Arithmetic(tuple(sorted(dots, key=repr)), frozenset(instructions))


@pytest.mark.parametrize("card", ("sm_80", "sm_89", "sm_90"))
def test_the_largest_linear_tiles_fit_every_card(card):
    """Per limit (sm_86 has sm_89's, hence its tiles): the K-quant linear at 1,024 rows in bfloat16, the tiles with
    the most shared memory (every other type, float32, the 16-row tiles: the slow tests)."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS[card]
    _check_resources(_linear_launches("Q4_K", torch.bfloat16, 1024, gpu), gpu)


def test_the_layer_kernels_fit_the_smallest_card():
    """Attention (both parts), the norms and RoPE at heads of 128 on a card of 99 KB per block (every card, dtype
    and head size: the slow tests)."""
    from offspec.formats.gpu.launch import CARDS

    _check_resources(_layer_launches(torch.bfloat16, CARDS["sm_89"]), CARDS["sm_89"])


@pytest.mark.parametrize("card", ("sm_80", "sm_90"))
def test_a_linear_runs_one_arithmetic_at_every_row_count(card):
    """Q8_0 (every type, bfloat16 and float32, three weights in a group: the slow test)."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS[card]
    seen = {rows: _arithmetic(_linear_launches("Q8_0", torch.bfloat16, rows, gpu), gpu) for rows in ROW_COUNTS}
    assert len(set(seen.values())) == 1, seen
    arithmetic = seen[1]
    assert any(op.startswith("mma.sync.aligned.m16n8k16") for op in arithmetic.instructions), arithmetic
    assert not any(op.startswith(("wgmma", "tcgen05")) for op in arithmetic.instructions), arithmetic
    assert all(layout[2].startswith("mma v2") for dot in arithmetic.dots for layout in dot[0]), arithmetic.dots


def test_the_comparison_sees_what_made_the_h100s_rows_differ():
    """The two causes, seen by the same comparison: a weight decoded from bytes gets operands of kWidth 4 (K ordered
    otherwise inside each mma.sync) where one loaded as 16-bit values gets 2 (the old scratch GEMM against the fused
    kernel); with contraction on, the assembler is left multiplies and adds it may fuse where it likes."""
    from offspec.formats.gpu import aot
    from offspec.formats.gpu.launch import CARDS, Launch

    gpu = CARDS["sm_90"]
    quant = _arithmetic(_linear_launches("Q8_0", torch.bfloat16, 1024, gpu), gpu)
    floats = _arithmetic(_linear_launches("F16", torch.bfloat16, 1024, gpu), gpu)
    assert {layout[1] for dot in quant.dots for layout in dot[0]} == {4}
    assert {layout[1] for dot in floats.dots for layout in dot[0]} == {2}
    assert quant != floats  # what the row-count comparison above reports where two paths feed mma.sync differently
    reduce = next(lc for lc in _linear_launches("Q8_0", torch.bfloat16, 1, gpu) if lc.kernel.fn.__name__ == "_reduce")
    fused = Launch(reduce.kernel, reduce.grid, reduce.args, dict(reduce.kwargs, enable_fp_fusion=True))
    assert aot.contractible(aot.arithmetic(aot.compile_launch(fused, gpu)))  # contraction on: add.f32, free to fuse
    assert not aot.contractible(aot.arithmetic(aot.compile_launch(reduce, gpu)))  # as offspec launches it


def test_without_disable_mma_v3_hopper_would_get_wgmma(monkeypatch):
    """What launch.py's DISABLE_MMA_V3 keeps away (read by triton 3.6 and 3.9 alike when a kernel compiles)."""
    from offspec.formats.gpu import aot
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS["sm_90"]
    prefix = next(lc for lc in _layer_launches(torch.bfloat16, gpu, 4, 2, 64, 256) if lc.kernel.fn.__name__ == "_prefix")
    assert not any(op.startswith("wgmma") for op in aot.arithmetic(aot.compile_launch(prefix, gpu)).instructions)
    monkeypatch.delenv("DISABLE_MMA_V3")
    assert any(op.startswith("wgmma") for op in aot.arithmetic(aot.compile_launch(prefix, gpu)).instructions)


def test_tiles_follow_the_cards_shared_memory():
    from offspec.formats.gpu.launch import CARDS
    from offspec.formats.gpu.linear import tiles

    small, large = CARDS["sm_89"], CARDS["sm_90"]
    assert tiles(1, torch.bfloat16, 8, small).bm == 16 and tiles(1024, torch.bfloat16, 8, small).bm == 64
    assert tiles(1024, torch.bfloat16, 8, small).stages < tiles(1024, torch.bfloat16, 8, large).stages
    assert tiles(1024, torch.float32, 8, small).stages < tiles(1024, torch.bfloat16, 8, small).stages
    assert tiles(1024, torch.bfloat16, 1, small).stages == 3  # a 32-value unit's tiles fit three stages anywhere


def test_attention_tiles_follow_the_cards_shared_memory():
    """float32 heads of 128 took 180,480 B in 64-row tiles, 3 stages deep (the slow sweep found it on sm_86)."""
    from offspec.formats.gpu.attention import BLOCK_N, tiles
    from offspec.formats.gpu.launch import CARDS

    small, large = CARDS["sm_89"].max_shared, CARDS["sm_90"].max_shared
    assert tiles(128, BLOCK_N, 4, small)[0] < 64 and tiles(128, BLOCK_N, 4, large)[0] == 64
    assert tiles(128, BLOCK_N, 2, small) == (64, 2) and tiles(128, BLOCK_N, 2, large) == (64, 3)


@pytest.mark.slow
@pytest.mark.parametrize("card, type_name, dtypes", LARGEST, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_every_types_largest_tiles_fit_every_card(card, type_name, dtypes):
    """Per card limit: each type's linear at 1,024 rows (the 64-row tiles, their pipelining as deep as the card's
    shared memory allows: what the H100 could not launch), in bfloat16 and float32 (float16 takes bfloat16's bytes,
    hence its tiles). sm_86 has sm_89's limits but its own ptxas registers."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS[card]
    for dtype in dtypes:
        _check_resources(_linear_launches(type_name, getattr(torch, dtype), 1024, gpu), gpu)


@pytest.mark.slow
@pytest.mark.parametrize("card", ("sm_80", "sm_86", "sm_89", "sm_90"))
def test_the_layer_kernels_fit_every_card(card):
    """The layer kernels of heads of 128 (attention's tiles follow the card too), in bfloat16 and float32."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS[card]
    for dtype in (torch.bfloat16, torch.float32):
        _check_resources(_layer_launches(dtype, gpu), gpu)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, type_name", TILINGS)
def test_every_tiling_and_decode_fits_the_smallest_card(dtype, type_name):
    """sm_89 (99 KB a block, as the RTX 3090 and 4090): each type's linear at 1 row (the 16-row tiles) and 17 (the
    64-row tiles, the K splits summed apart), with a bias (without one a launch only loads less), and its decodes (a
    token table's rows in float32, a weight into the compute dtype). Registers per thread and per block have one
    limit on every card from sm_80 to sm_90; shared memory is smallest here (the largest tiles on the other cards:
    the test above)."""
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl
    from offspec.formats.gpu.launch import CARDS, recording

    gpu, dtype = CARDS["sm_89"], getattr(torch, dtype)
    for rows in (1, 17):
        _check_resources(_linear_launches(type_name, dtype, rows, gpu), gpu)
    t = ggml_type(type_name)
    with recording(gpu) as decodes:
        gl.decode(torch.zeros((70, t.row_bytes(512)), dtype=torch.uint8), t.id, 512, torch.float32)
        gl.decode(torch.zeros((70, t.row_bytes(512)), dtype=torch.uint8), t.id, 512, dtype)
    _check_resources(decodes, gpu)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_layer_kernels_of_heads_of_64_fit_the_smallest_card(dtype):
    from offspec.formats.gpu.launch import CARDS

    _check_resources(_layer_launches(dtype, CARDS["sm_89"], 14, 2, 64, 896), CARDS["sm_89"])


@pytest.mark.slow
@pytest.mark.parametrize("card, dtype, type_name", ARITHMETIC)
def test_every_types_linear_runs_one_arithmetic_at_every_row_count(card, dtype, type_name):
    """Each type in a group of three weights, at 1, 17, 64 and 1,024 rows: both cards' MMA (v2 on both: no wgmma)
    and both operand widths (16-bit values, float32 as tf32-free IEEE products), one pair each (every pair cost
    six minutes more of CI with Triton's cache cold); the lattice and ternary types on sm_90's pair only."""
    from offspec.formats.gpu.launch import CARDS

    gpu, dtype = CARDS[card], getattr(torch, dtype)
    seen = {rows: _arithmetic(_linear_launches(type_name, dtype, rows, gpu, group=3), gpu) for rows in ROW_COUNTS}
    assert len(set(seen.values())) == 1, (type_name, seen)
    assert not any(op.startswith(("wgmma", "tcgen05")) for a in seen.values() for op in a.instructions)


# the routed experts' grouped linears (offspec/formats/gpu/experts.py): the types mixtures ship their experts in
EXPERT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4")


def test_the_grouped_expert_tiles_fit_the_smallest_card():
    """Q4_K's gate and up of 8 experts with biases, 1 row each (tiles of 16 rows) and 1,024 (of 64, pipelined as
    deep as sm_89's 99 KB allow) in bfloat16 (every expert type, card and dtype: the slow test)."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS["sm_89"]
    for rows in (1, 1024):
        _check_resources(_grouped_launches("Q4_K", torch.bfloat16, rows, gpu), gpu)


def test_a_grouped_expert_row_runs_the_arithmetic_of_its_linear():
    """An expert's rows in a grouped launch go through what `linear` computes them with (operand layouts, PTX
    arithmetic, no contraction), at 1 row an expert and at 1,024 (sm_90, bfloat16; every type: the slow test)."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS["sm_90"]
    want = _arithmetic(_linear_launches("Q4_K", torch.bfloat16, 1024, gpu), gpu)
    for rows in (1, 1024):
        assert _arithmetic(_grouped_launches("Q4_K", torch.bfloat16, rows, gpu), gpu) == want, rows


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS_)
@pytest.mark.parametrize("type_name", EXPERT_TYPES)
def test_every_expert_types_grouped_tiles_fit_every_card(card, type_name):
    """Gate and up with biases at 1,024 rows an expert (the largest tiles), bfloat16 and float32; and 1 row (the
    16-row tiles) on the card of the least shared memory."""
    from offspec.formats.gpu.launch import CARDS

    gpu = CARDS[card]
    for dtype in (torch.bfloat16, torch.float32):
        _check_resources(_grouped_launches(type_name, dtype, 1024, gpu), gpu)
        if card == "sm_89":
            _check_resources(_grouped_launches(type_name, dtype, 1, gpu), gpu)


@pytest.mark.slow
@pytest.mark.parametrize("card, dtype", [("sm_90", "bfloat16"), ("sm_80", "float32")])
@pytest.mark.parametrize("type_name", EXPERT_TYPES)
def test_every_expert_types_grouped_rows_run_the_arithmetic_of_its_linear(card, dtype, type_name):
    from offspec.formats.gpu.launch import CARDS

    gpu, dtype = CARDS[card], getattr(torch, dtype)
    want = _arithmetic(_linear_launches(type_name, dtype, 1024, gpu), gpu)
    for rows in (1, 17, 1024):
        assert _arithmetic(_grouped_launches(type_name, dtype, rows, gpu), gpu) == want, (type_name, rows)


def test_the_probe_launches_a_mixtures_grouped_experts_at_both_row_tiles(tmp_path, monkeypatch):
    """The load-time probe (gpu/probe.py) launches what `layer_ffn` will: a tiny gpt-oss's MXFP4 experts, gate and up
    in one launch, down alone, with biases, at 16- and 64-row tiles; they fit the smallest card."""
    import offspec
    from helpers.tiny_gguf import save_tiny_gguf
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu.launch import CARDS, recording
    from offspec.formats.gpu.probe import _launches, expert_cases

    monkeypatch.setenv("OFFSPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = save_tiny_gguf(tmp_path / "oss.gguf", "gpt-oss", seed=0, types={"experts": "MXFP4", "down_exps": "MXFP4"})
    gen = offspec.load(str(path), "none", budget=4, max_context=64)
    try:
        cases = expert_cases(gen.engine.target.model, torch.device("cpu"))
        assert expert_cases(gen.engine.target.model, torch.device("cuda")) == set()  # experts not on that device
    finally:
        gen.close()
    mxfp4 = ggml_type("MXFP4").id
    assert {(c.type_id, c.parts, c.bias) for c in cases} == {(mxfp4, 2, True), (mxfp4, 1, True)}, cases
    gpu = CARDS["sm_89"]
    with recording(gpu) as launches:
        for _, run in _launches(torch.device("cpu"), torch.bfloat16, (), (), (), cases):
            run()
    assert [launch.kernel.fn.__name__ for launch in launches] == ["_grouped"] * 4
    assert sorted(launch.kwargs["BM"] for launch in launches) == [16, 16, 64, 64]
    assert sorted(launch.kwargs["PARTS"] for launch in launches) == [1, 1, 2, 2]
    _check_resources(launches, gpu)
