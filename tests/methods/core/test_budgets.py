"""The shared budget mechanisms: apportioning and the uniform and cosine layer schedules."""

from __future__ import annotations

import pytest

from kvfold.methods.core.budgets import apportion, cosine_layer_budgets, uniform_layer_budgets

# ---------------------------------------------------------------------------- layer schedules


def test_apportion_sums_and_bounds():
    assert apportion([1, 1, 1], 10) == [4, 3, 3]  # largest remainder, ties to the lower index
    got = apportion([10, 1, 1, 0], 40, minimum=3, maximum=20)
    assert sum(got) == 40 and min(got) >= 3 and max(got) <= 20 and got[0] == 20
    assert apportion([0, 0], 5) == [3, 2]
    with pytest.raises(ValueError):
        apportion([1, 1], 10, minimum=6)
    with pytest.raises(ValueError):
        apportion([1, 1], 10, maximum=4)
    with pytest.raises(ValueError):
        apportion([1, 0], 10, maximum=6)  # the zero-weight part can never grow


def test_uniform_layer_budgets():
    assert uniform_layer_budgets(64, 3) == [64, 64, 64]


@pytest.mark.parametrize("avg,layers,ratio", [(100, 30, 0.2), (10, 5, 0.5), (7, 12, 0.1)])
def test_cosine_decays_with_exact_total(avg, layers, ratio):
    got = cosine_layer_budgets(avg, layers, min_ratio=ratio, min_budget=2)
    assert sum(got) == avg * layers
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))
    assert min(got) >= 2
    if avg >= 100:  # no clamping: first/last follow 2·avg/(1+r) and 2·r·avg/(1+r)
        assert abs(got[0] - 2 * avg / (1 + ratio)) < 1
        assert abs(got[-1] - 2 * ratio * avg / (1 + ratio)) < 1


def test_cosine_respects_minimum_and_context():
    got = cosine_layer_budgets(40, 10, min_ratio=0.05, context_tokens=60, min_budget=20)
    assert sum(got) == 400 and min(got) >= 20 and max(got) <= 60
