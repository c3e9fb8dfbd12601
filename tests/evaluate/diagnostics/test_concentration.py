"""The load measures of the merge-map diagnostic, by hand and on a constructed map."""

from __future__ import annotations

import numpy as np
import pytest

from kvfold.evaluate.diagnostics.concentration import carrier_load, gini, lorenz_curve, span_boundaries, top_share


def test_load_measures_by_hand():
    assert gini(np.array([1.0, 1.0, 1.0, 1.0])) == pytest.approx(0.0)
    assert gini(np.array([0.0, 0.0, 0.0, 4.0])) == pytest.approx(0.75)  # (n − 1) / n: all on one entry
    assert top_share(np.array([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 0.1) == pytest.approx(0.5)
    assert top_share(np.array([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 0.2) == pytest.approx(0.6)
    curve = lorenz_curve(np.array([3.0, 1.0]), points=3)
    assert curve.tolist() == pytest.approx([0.0, 0.75, 1.0])
    assert span_boundaries(np.array([0, 1, 2, 10, 11, 20])).tolist() == [True, False, True, True, True, True]


def test_carrier_load_on_a_constructed_map():
    retained = np.array([0, 1, 2, 10, 11, 20])  # spans [0, 2], [10, 11], [20]
    carriers = np.array([1, 2, 2, 10, 20, 20])  # loads 0, 1, 2, 1, 0, 2
    m = carrier_load(retained, carriers, np.ones(6), evicted=12)
    assert m["absorbed"] == 6 and m["merged_fraction"] == pytest.approx(0.5)
    assert m["active"] == pytest.approx(4 / 6)
    assert m["top1_share"] == m["top10_share"] == pytest.approx(2 / 6)  # ⌈0.06⌉ = ⌈0.6⌉ = 1 entry
    assert m["gini"] == pytest.approx(16 / 36)  # sorted (0, 0, 1, 1, 2, 2): 2·29/36 − 7/6
    assert m["max_load"] == 2 and m["max_over_mean"] == pytest.approx(2.0)
    assert m["boundary_share"] == pytest.approx(5 / 6) and m["boundary_fraction"] == pytest.approx(5 / 6)
    half = carrier_load(retained, np.array([1, 2]), np.array([0.5, 0.5]), evicted=1)  # one token over two carriers
    assert half["absorbed"] == 1 and half["merged_fraction"] == 1 and half["gini"] == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="not among the retained"):
        carrier_load(retained, np.array([5]), np.ones(1), evicted=1)
