"""The head-budget schedule's per-head counts (:mod:`kvfold.methods.core.head_schedule`)."""

from __future__ import annotations

import torch

from kvfold.methods.core.head_schedule import HeadSchedule


def test_counts_split_the_budget_by_the_shares_and_round_a_fractional_average():
    schedule = HeadSchedule("m", "hash", [0, 1], [[0.5, 0.1], [0.3, 0.1]])
    valid = {0: torch.tensor([[40, 40]]), 1: torch.tensor([[40, 40]])}
    counts = schedule.counts(torch.tensor([10]), valid)
    assert [counts[0][0].tolist(), counts[1][0].tolist()] == [[20, 4], [12, 4]]  # 40 entries by 0.5/0.1/0.3/0.1
    fractional = schedule.counts(torch.tensor([10.4], dtype=torch.float64), valid)
    assert sum(int(c.sum()) for c in fractional.values()) == round(10.4 * 4)  # 42, not int(10.4) · 4 = 40
    capped = schedule.counts(torch.tensor([10]), {0: torch.tensor([[12, 40]]), 1: torch.tensor([[40, 40]])})
    assert int(capped[0][0, 0]) == 12  # a head keeps at most its valid entries
