"""The bench's process helpers (:mod:`kvfold.evaluate.bench.process`)."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident high-water mark is Linux's")
def test_peak_over_measures_the_stretch_not_what_came_before():
    """:class:`PeakOver` on a CPU: 256 MB touched and freed before the stretch do not count; 128 MB
    touched and freed inside it do."""
    import torch

    from kvfold.evaluate.bench.process import PeakOver

    before = torch.ones(64 << 20)  # 256 MB, touched
    del before
    peak = PeakOver("cpu").start()
    assert peak.stop() < 64
    peak = PeakOver("cpu").start()
    inside = torch.ones(32 << 20)  # 128 MB
    del inside
    assert 120 < peak.stop() < 200
