"""The CPU's exact attention (csrc/attention.h): softmax attention per query over its visible keys, whose bits depend
on that query and those keys only, whatever else the pass holds and however the query heads that share a key head
are grouped."""

from __future__ import annotations

import pytest
import torch

from offspec.formats import kernels


@pytest.fixture(scope="module")
def ext():
    assert kernels.load_kernels() is None, "the CPU kernels did not build"
    return kernels.compiled()


def _inputs(seed: int, H: int, Hkv: int, Q: int, L: int, D: int, share: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, Q, D, generator=g)  # (1, H, Q, D)
    k = torch.randn(1, Hkv, L, D, generator=g) * 2  # (1, Hkv, L, D)
    v = torch.randn(1, Hkv, L, D, generator=g)
    visible = torch.rand(Q, L, generator=g) < share  # (Q, L) bool
    return q, k, v, visible


def _reference(q, k, v, visible, scale: float, softcap: float) -> torch.Tensor:
    """(1, Q, H, D) in float64: softmax over the visible keys, zeros where a query sees none."""
    H, Hkv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(H // Hkv, dim=1)[0]  # (H, L, D)
    vv = v.double().repeat_interleave(H // Hkv, dim=1)[0]
    s = torch.einsum("hqd,hld->hql", q.double()[0], kk) * scale  # (H, Q, L)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: all zeros
    return torch.einsum("hql,hld->qhd", p, vv)[None]


# heads and key heads (groups of 1 to 8 query heads), head sizes with and without a whole number of vector chunks
SHAPES = [(12, 2, 128), (14, 2, 64), (9, 3, 64), (4, 1, 256), (8, 8, 80), (6, 1, 72), (10, 2, 40), (8, 1, 32)]


@pytest.mark.parametrize("H,Hkv,D", SHAPES)
@pytest.mark.parametrize("softcap", (0.0, 30.0))
def test_attention_is_softmax_over_the_visible_keys(ext, H, Hkv, D, softcap):
    q, k, v, visible = _inputs(H * D, H, Hkv, Q=7, L=45, D=D)
    visible[2] = False  # a query that sees no key
    visible[3] = False
    visible[3, 44] = True  # ... and one that sees a single one
    out = ext.attend(q, k, v, visible, D ** -0.5, softcap)  # (1, Q, H, D)
    want = _reference(q, k, v, visible, D ** -0.5, softcap)
    assert out.shape == (1, 7, H, D)
    assert torch.equal(out[0, 2], torch.zeros(H, D))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", (1, 7, 8, 16, 45, 300))
def test_keys_far_below_the_largest_weigh_nothing_and_the_rest_as_softmax_does(ext, L):
    """Scores spread over hundreds (a large scale): the keys more than 87 below a query's largest (exponentials below
    the smallest normal float) weigh nothing, the others as softmax weighs them, at lengths that end a vector of 8
    or 16 keys or fall short of one."""
    q, k, v, visible = _inputs(L, 4, 1, Q=3, L=L, D=64, share=0.8)
    visible[:, 0] = True  # every query sees at least one key
    out = ext.attend(q, k, v, visible, 3.0, 0.0)
    torch.testing.assert_close(out.double(), _reference(q, k, v, visible, 3.0, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", (7, 8, 9, 15, 16, 17, 31, 33))
def test_a_keys_weight_does_not_depend_on_where_its_vector_lane_falls(ext, L):
    """Keys that weigh exactly nothing (scores far below the largest) put first shift every other key's exponential
    to another lane, or from a whole vector to the one-by-one rest: the output keeps every bit."""
    q, k, v, _ = _inputs(L, 1, 1, Q=1, L=L, D=64)
    out = ext.attend(q, k, v, torch.ones(1, L, dtype=torch.bool), 0.125, 0.0)
    for extra in (1, 2, 3, 9):
        k2 = torch.cat([-1e3 * q.expand(1, 1, extra, 64), k], dim=2)  # (1, 1, extra + L, 64): scores far below
        v2 = torch.cat([torch.randn(1, 1, extra, 64), v], dim=2)
        shifted = ext.attend(q, k2, v2, torch.ones(1, extra + L, dtype=torch.bool), 0.125, 0.0)
        assert torch.equal(shifted.view(torch.int32), out.view(torch.int32)), extra


@pytest.mark.parametrize("H,Hkv,D", SHAPES)
def test_a_querys_bits_depend_on_it_and_its_visible_keys_only(ext, H, Hkv, D):
    q, k, v, visible = _inputs(H + D, H, Hkv, Q=9, L=70, D=D)
    out = ext.attend(q, k, v, visible, D ** -0.5, 0.0)
    for i in (0, 4, 8):
        # the query alone, with what it may not see replaced by other numbers
        k2, v2 = k.clone(), v.clone()
        hidden = ~visible[i]
        k2[:, :, hidden] = 1e3 * torch.randn(Hkv, int(hidden.sum()), D)
        v2[:, :, hidden] = -7.0
        alone = ext.attend(q[:, :, i : i + 1].clone(), k2, v2, visible[i : i + 1].clone(), D ** -0.5, 0.0)
        assert torch.equal(alone[0, 0].view(torch.int32), out[0, i].view(torch.int32))


@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (7, 1, 64), (8, 1, 40)])
def test_a_heads_bits_do_not_depend_on_the_heads_grouped_with_it(ext, H, Hkv, D):
    """The query heads of one key head run together (up to 4 at a time); each head alone (one query head per key
    head) computes the same bits."""
    q, k, v, visible = _inputs(3 * H, H, Hkv, Q=5, L=33, D=D)
    out = ext.attend(q, k, v, visible, D ** -0.5, 0.0)
    group = H // Hkv
    for h in range(H):
        kv = h // group
        alone = ext.attend(q[:, h : h + 1].clone(), k[:, kv : kv + 1].clone(), v[:, kv : kv + 1].clone(), visible,
                           D ** -0.5, 0.0)
        assert torch.equal(alone[0, :, 0].view(torch.int32), out[0, :, h].view(torch.int32))


def test_a_long_causal_pass_gives_each_row_the_bits_of_its_own_step(ext):
    """A prefill chunk (causal) and one-token steps over the same cache: the same bits, row by row."""
    H, Hkv, D, L = 12, 2, 128, 300
    q, k, v, _ = _inputs(5, H, Hkv, Q=L, L=L, D=D)
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    out = ext.attend(q, k, v, causal, D ** -0.5, 0.0)
    for i in (0, 1, 150, 299):
        step = ext.attend(q[:, :, i : i + 1].clone(), k, v, causal[i : i + 1].clone(), D ** -0.5, 0.0)
        assert torch.equal(step[0, 0], out[0, i])


def _sink_reference(q, k, v, visible, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """(1, Q, H, D) in float64: gpt-oss's attention, each head's sink one more logit in the softmax, with no value."""
    H, Hkv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(H // Hkv, dim=1)[0]  # (H, L, D)
    vv = v.double().repeat_interleave(H // Hkv, dim=1)[0]
    s = torch.einsum("hqd,hld->hql", q.double()[0], kk) * scale  # (H, Q, L)
    s = s.masked_fill(~visible, float("-inf"))
    column = sinks.double().reshape(-1, 1, 1).expand(-1, s.shape[1], 1)  # (H, Q, 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]  # the sink's weight dropped
    return torch.einsum("hql,hld->qhd", p, vv)[None]


@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (8, 2, 64), (9, 3, 64)])
def test_attention_sinks_take_their_share_of_the_softmax_and_keep_a_row_its_own(ext, H, Hkv, D):
    q, k, v, visible = _inputs(7 * H + D, H, Hkv, Q=9, L=40, D=D)
    visible[2] = False  # a query that sees no key: all its weight on the sink, so zeros
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(H)) * 3  # (H,) some above every score
    out = ext.attend(q, k, v, visible, D ** -0.5, 0.0, sinks)  # (1, Q, H, D)
    torch.testing.assert_close(out.double(), _sink_reference(q, k, v, visible, D ** -0.5, sinks), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(out[0, 2], torch.zeros(H, D))
    assert not torch.allclose(out, ext.attend(q, k, v, visible, D ** -0.5, 0.0))  # the sinks change the rows
    for i in range(9):  # each query alone: the same bits
        alone = ext.attend(q[:, :, i : i + 1].clone(), k, v, visible[i : i + 1].clone(), D ** -0.5, 0.0, sinks)
        assert torch.equal(alone[0, 0], out[0, i]), i
