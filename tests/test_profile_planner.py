"""The planner on synthetic curves whose optimum is known, and the curves it reads."""

import math

import pytest

from offspec import OffspecError
from offspec.profile.auto import ESTIMATE_TARGET  # imported here: the test below replaces timing.timed for a while
from offspec.profile.curves import AcceptanceCurve, CostCurve
from offspec.profile.planner import PairCosts, PlannerConfig, auto_beams, draft_seconds, evaluate, plan
from offspec.profile.report import plan_summary

POW2 = tuple(2**i for i in range(13))  # 1 .. 4096
FREE_DRAFT = CostCurve.of([(1, 0.0)])


def saturating(budgets, top, scale):
    return AcceptanceCurve.of(budgets, [top * (1 - math.exp(-b / scale)) for b in budgets])


def test_flat_then_linear_cost_picks_the_knee():
    # offloading-like: a pass costs the same up to 257 tokens (the weights' transfer), then grows linearly
    target = CostCurve.of([(1, 0.1), (257, 0.1), (513, 0.2)])
    costs = PairCosts(target_pass=target, target_head=0.0, draft_step=FREE_DRAFT)
    result = plan(costs, saturating(POW2, 8.0, 64.0), PlannerConfig(budgets=POW2))
    assert result.best.budget == 256  # 1 + 8(1 - e^-4) tokens per 0.1 s pass
    assert result.best.tokens_per_second == pytest.approx((1 + 8 * (1 - math.exp(-4))) / 0.1)
    assert result.autoregressive_tokens_per_second == pytest.approx(10.0)
    assert result.speedup == pytest.approx(result.best.tokens_per_second / 10.0)


def test_linear_cost_matches_brute_force_optimum():
    # CPU-like: every token of the tree costs; acceptance saturates. Candidates and acceptance points on every
    # integer budget, so interpolation is exact and the argmax of the formula is the answer.
    budgets = tuple(range(1, 65))
    acceptance = saturating(budgets, 3.0, 8.0)
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.32), (65, 1.6)]), target_head=0.0, draft_step=FREE_DRAFT)
    result = plan(costs, acceptance, PlannerConfig(budgets=budgets))

    def rate(b):
        return (1 + 3.0 * (1 - math.exp(-b / 8.0))) / (0.3 + 0.02 * (b + 1))

    expected = max(budgets, key=rate)
    assert 1 < expected < 64  # an interior optimum
    assert result.best.budget == expected
    assert result.best.tokens_per_second == pytest.approx(rate(expected))
    assert [p.budget for p in result.curve] == list(budgets)


def test_beams_trade_step_count_against_step_cost():
    # a step costs 0.05 s + 0.01 s per node and a 64-node tree is 4 levels deep: fewer than 16 nodes per step
    # needs more than 4 steps, more than 16 makes each of the (at least 4) steps dearer
    acceptance = AcceptanceCurve.of([64], [3.0], depths=[4.0])
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.1), (65, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.06), (256, 2.61)]))
    result = plan(costs, acceptance, PlannerConfig(budgets=(64,)))
    assert result.best.max_beams == 16
    # GPU-like flat step cost: the fewest steps win; at depth 4, 16 nodes per step already need only 4 steps
    # (ties go to fewer beams), on a shallow bushy tree the widest step wins
    flat = PairCosts(target_pass=costs.target_pass, target_head=0.0, draft_step=CostCurve.of([(1, 0.05), (256, 0.05)]))
    assert plan(flat, acceptance, PlannerConfig(budgets=(64,))).best.max_beams == 16
    bushy = AcceptanceCurve.of([64], [3.0], depths=[1.0])
    assert plan(flat, bushy, PlannerConfig(budgets=(64,))).best.max_beams == 64


def test_depth_cap_from_per_pass_samples():
    # one pass in ten accepts 40 tokens; a deep tree costs 40 draft steps every pass, so a cap of 4 wins
    samples = [[2]] * 9 + [[40]]
    acceptance = AcceptanceCurve.of([64], [5.8], depths=[40.0], samples=samples)
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.1), (65, 0.1)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 0.05), (256, 0.05)]))
    result = plan(costs, acceptance, PlannerConfig(budgets=(64,), beams=(64,)))
    assert result.best.max_depth == 4
    assert result.best.accepted == pytest.approx(2.2)
    assert evaluate(costs, acceptance, 64, 64, 64).accepted == pytest.approx(5.8)


def test_walk_cost_and_acceptance_scale():
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.1), (257, 0.1)]), target_head=0.01, draft_step=FREE_DRAFT)
    acceptance = saturating(POW2, 4.0, 16.0)
    point = evaluate(costs, acceptance, 16, 4, 32)
    assert point.target_seconds == pytest.approx(0.1 + (1 + point.accepted) * 0.01)
    assert evaluate(costs, acceptance, 16, 4, 32, acceptance_scale=2.0).accepted == pytest.approx(2 * point.accepted)
    assert evaluate(costs, acceptance, 2, 4, 32, acceptance_scale=100.0).accepted == 2.0  # never above the budget


def test_measured_tree_growth_scales_the_model_and_holds_its_ratio_past_the_largest_budget():
    """A budget-1 tree is one draft forward (the catch-up gives the root's children): measured whole-tree times
    replace the single-step model's guesses, and past the largest budget measured the model keeps the ratio it had
    there instead of a straight line through two tree times."""
    step = CostCurve.of([(1, 0.03), (2, 0.031), (64, 0.06)])
    base = PairCosts(target_pass=CostCurve.of([(1, 0.07), (65, 0.3)]), target_head=0.0, draft_step=step)
    acceptance = saturating(POW2, 4.0, 8.0)
    modelled = {b: draft_seconds(base, acceptance, b, 1, 64) for b in (1, 2, 64)}
    assert modelled[1] == pytest.approx(0.031 + 0.03)  # the model charges a chain of 1 a step too many
    measured = PairCosts(**{**base.__dict__, "draft_propose": CostCurve.of([(1, 0.03), (2, 0.062)])})
    assert draft_seconds(measured, acceptance, 1, 1, 64) == pytest.approx(0.03)
    ratio = 0.062 / draft_seconds(base, acceptance, 2, auto_beams(2), 64)
    assert draft_seconds(measured, acceptance, 64, 1, 64) == pytest.approx(modelled[64] * ratio)


def test_slow_draft_is_flagged_and_max_budget_respected():
    costs = PairCosts(target_pass=CostCurve.of([(1, 0.01), (64, 0.5)]), target_head=0.0,
                      draft_step=CostCurve.of([(1, 1.0), (64, 1.0)]))
    result = plan(costs, saturating(POW2, 2.0, 8.0), PlannerConfig(max_budget=48))
    assert result.speedup < 1 and not result.speculates
    assert any("decodes with the target alone" in n for n in result.notes)
    assert plan_summary(result).startswith("chosen: the target alone (--budget auto decodes without a tree)")
    assert max(p.budget for p in result.curve) <= 48
    with pytest.raises(OffspecError, match="max_budget"):
        plan(costs, saturating(POW2, 2.0, 8.0), PlannerConfig(max_budget=0))


def test_cost_curve_interpolates_extrapolates_and_drops_noise():
    curve = CostCurve.of([(1, 0.3), (2, 0.9), (4, 0.35), (8, 0.4), (16, 0.8)])
    assert curve(2) == pytest.approx(0.35)  # a noise spike above a bigger size's time is dropped
    assert curve(12) == pytest.approx(0.6)
    assert curve(32) == pytest.approx(1.6)  # linear past the last point with the last slope
    assert curve(0.5) == pytest.approx(0.3)
    with pytest.raises(OffspecError):
        CostCurve.of([])


def test_acceptance_curve_is_monotone_and_flat_past_its_end():
    acc = AcceptanceCurve.of([1, 4, 16], [0.5, 0.4, 2.0])
    assert acc.accepted == (0.5, 0.5, 2.0)  # a bigger tree contains the smaller one
    assert acc(8) == pytest.approx(0.5 + 1.5 * 0.5)  # halfway in log2 between 4 and 16
    assert acc(1000) == 2.0
    assert acc(0) == 0.0
    with pytest.raises(OffspecError):
        AcceptanceCurve.of([4, 2], [1.0, 2.0])


def test_sweeps_stop_when_compute_bound_and_probe_past_streaming(monkeypatch):
    import torch

    from offspec.profile import timing

    def fake_times(cost):
        calls = []
        monkeypatch.setattr(timing, "timed", lambda fn, device: (calls.append(fn()), cost(calls[-1]))[1])
        return calls

    cpu = torch.device("cpu")
    # compute-bound from the start: once two doublings up to >= 16 tokens doubled the time, it stops (not at 4096)
    fake_times(lambda n: 0.01 * n)
    points, bound = timing.sweep(lambda n: n, cpu, timing.SweepConfig(repeats=1), "t", "t")
    assert [n for n, _ in points] == [1, 2, 4, 8, 16, 32] and bound == 8
    # weights streamed: 2 s per pass whatever the size until compute takes over past 512 tokens
    fake_times(lambda n: max(2.0, 0.01 * n))
    points, bound = timing.sweep(lambda n: n, cpu, timing.SweepConfig(repeats=1, max_call_seconds=1.0), "t", "t")
    assert [n for n, _ in points] == [1, 2, 16, 128, 1024] and bound is None
    curve = CostCurve.of(points)
    assert curve(100) == pytest.approx(2.0) and curve(2048) > curve(1024) > 2.0
    # the start-up estimate's sweep: a streamed pass over max_call_seconds at 2 tokens (a noisy disk) is probed
    # further, not extrapolated from two points
    fake_times(lambda n: 0.46 if n == 1 else max(0.64, 0.002 * n))
    points, _ = timing.sweep(lambda n: n, cpu, ESTIMATE_TARGET, "t", "t")
    assert [n for n, _ in points] == [1, 2, 16, 128, 1024]
    assert CostCurve.of(points)(65) == pytest.approx(0.64)
    # out of time where the cost already grew (a CPU): no probe of far bigger, far slower sizes
    fake_times(lambda n: 0.5 if n < 4 else 5.0)
    points, bound = timing.sweep(lambda n: n, cpu, timing.SweepConfig(repeats=1, max_call_seconds=1.0), "t", "t")
    assert [n for n, _ in points] == [1, 2, 4] and bound is None


def test_a_head_that_covers_several_walk_positions_in_one_call_is_charged_by_calls():
    """Where the LM head is row-invariant the engine computes the walk's likely rows in one call (HEAD_ROWS of them,
    about one row's seconds on a CPU): a tree that accepts 2 tokens pays one head call, not 3."""
    from offspec.config import PassCost, head_calls
    from offspec.spec.engine import HEAD_ROWS

    assert head_calls(3.0, 1) == 3.0 and head_calls(3.0, 4) == 1.0 and head_calls(6.0, 4) == 1.5
    per_position = PairCosts(target_pass=CostCurve.of([(1, 0.03), (9, 0.05)]), target_head=0.01, draft_step=FREE_DRAFT)
    batched = PairCosts(target_pass=per_position.target_pass, target_head=0.01, draft_step=FREE_DRAFT,
                        head_rows=HEAD_ROWS)
    acceptance = AcceptanceCurve.of((1, 2, 4, 8), [0.8, 1.6, 2.0, 2.4])
    assert evaluate(per_position, acceptance, 2, 1, 8).target_seconds == pytest.approx(0.035 + 0.026)  # 2.6 calls
    assert evaluate(batched, acceptance, 2, 1, 8).target_seconds == pytest.approx(0.035 + 0.01)  # one call
    assert batched.autoregressive_seconds() == per_position.autoregressive_seconds() == pytest.approx(0.04)
    assert batched.scaled(target=2.0).head_rows == HEAD_ROWS
    # the per-pass cost model (suffix candidates, the hybrid's choice) charges the same way
    cost = PassCost(base=0.03, per_node=0.0025, head=0.01, head_rows=HEAD_ROWS)
    assert cost.seconds(2, 2.6) == pytest.approx(0.03 + 0.005 + 0.01)
    assert PassCost(base=0.03, per_node=0.0025, head=0.01).seconds(2, 2.6) == pytest.approx(0.035 + 0.026)


def test_the_engines_head_rows_reach_the_auto_policy_and_a_profile(tiny_pair):
    from offspec.profile.store import costs_of
    from offspec.spec.engine import HEAD_ROWS

    engine = tiny_pair.engine
    assert engine.head_rows == (HEAD_ROWS if engine.target.head_is_row_invariant else 1)
    data = {"timings": {"target_pass": [[1, 0.03]], "target_head_seconds": 0.01}}
    assert costs_of(data).head_rows == 1  # a profile from before head_rows: a call per position
    data["timings"]["head_rows"] = 4
    assert costs_of(data).head_rows == 4
    from offspec.profile.report import timings_table

    data["timings"]["draft_step"] = [[1, 0.01]]
    assert timings_table(data["timings"]).endswith("LM head + choice per call (up to 4 walk positions): 10.00 ms")


def test_a_thinned_curve_keeps_each_accepted_token_given_the_ones_before_it():
    """thinned(q): a calibration pass that accepted a tokens yields q + q^2 + ... + q^a, so a deep path loses more
    of its tokens than a one-node chain; without samples, the mean takes the same closed form."""
    curve = AcceptanceCurve.of((1, 2), [0.5, 1.0], samples=[[0, 0], [1, 2]])
    half = curve.thinned(0.5)
    assert half(1, 8) == pytest.approx(0.5 * 0.5)  # one pass of two: 0.5
    assert half(2, 8) == pytest.approx((0.5 + 0.25) / 2)  # a chain of 2: 0.5 + 0.25
    assert half(2, 1) == pytest.approx(0.5 / 2)  # capped at depth 1 first, then thinned
    assert half(2, 8) / curve(2, 8) < half(1, 8) / curve(1, 8)  # deeper budgets keep a smaller share
    assert curve.thinned(1.0)(2, 8) == curve(2, 8) and curve.thinned(1.0) == curve
    bare = AcceptanceCurve.of((1, 4), [0.8, 2.0])  # no samples: the mean as one path
    assert bare.thinned(0.5)(4) == pytest.approx(0.5 * (1 - 0.5 ** 2.0) / 0.5)
    with pytest.raises(OffspecError, match="keep"):
        curve.thinned(0.0)
