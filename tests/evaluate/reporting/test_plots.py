"""The budget axis of the plots: fractions, compression ratios, token counts."""

from __future__ import annotations

from kvfold.evaluate.reporting.plots import axis_positions


def test_fractions_spanning_8x_or_more_are_placed_as_compression_ratios():
    ratios, numeric = axis_positions([0.5, 0.25, 0.125, 0.0625, 0.03125])
    assert numeric and [ratios[b] for b in (0.5, 0.25, 0.125, 0.0625, 0.03125)] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    linear, _ = axis_positions([0.5, 0.2, 0.1])
    assert linear == {0.5: 0.5, 0.2: 0.2, 0.1: 0.1}
    counts, numeric = axis_positions([512, 0.1])
    assert not numeric and counts == {512: 0.0, 0.1: 1.0}
