"""The acceptance drift estimators on hand-made windows (offspec/profile/drift.py)."""

import pytest

from offspec.profile.curves import AcceptanceCurve
from offspec.profile.drift import WindowPass, expected_accepted, per_token_keep, ratio_scale

CURVE = AcceptanceCurve.of((1, 2, 4), [0.75, 1.5, 2.5], samples=[[1, 2, 4], [1, 2, 3], [1, 2, 3], [0, 0, 0]])


def window(budget: int, taken: list[int], depth: int = 8) -> list[WindowPass]:
    return [WindowPass(a, expected_accepted(CURVE, budget, depth), budget, depth) for a in taken]


def test_the_ratio_and_its_standard_error():
    assert ratio_scale([]) is None
    steady = window(2, [1, 2, 1, 2])  # predicted 1.5 each
    r, se = ratio_scale(steady)
    assert r == pytest.approx(1.0) and se == pytest.approx(0.5774 / (2 * 1.5), rel=1e-3)
    assert ratio_scale(window(2, [0, 0, 0, 0]))[0] == 0.0


def test_the_per_token_keep_predicts_what_the_window_took():
    assert per_token_keep([], CURVE) == 1.0
    assert per_token_keep(window(4, [3, 3]), CURVE) == 1.0  # more than predicted: no thinning
    mixed = window(4, [1, 2, 0, 1]) + window(1, [1, 0])
    keep = per_token_keep(mixed, CURVE)
    thinned = CURVE.thinned(keep)
    assert 0 < keep < 1
    assert sum(expected_accepted(thinned, w.budget, w.depth) for w in mixed) == pytest.approx(5, rel=1e-6)
    assert per_token_keep(window(4, [0] * 6), CURVE, floor=0.05) == 0.05  # nothing taken: the floor
