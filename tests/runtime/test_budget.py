"""Budget parsing and resolution."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.budget import Budget


@pytest.mark.parametrize(
    "value,fraction,tokens",
    [(0.1, 0.1, None), ("0.25", 0.25, None), (1, 1.0, None), ("1.0", 1.0, None), (512, None, 512), ("64", None, 64)],
)
def test_parse(value, fraction, tokens):
    budget = Budget.parse(value)
    assert budget.fraction == fraction and budget.tokens == tokens


@pytest.mark.parametrize("value", [0, "0", -1, 1.5, "2.5", "abc", "", None, True, float("nan")])
def test_parse_rejects_with_what_is_accepted(value):
    with pytest.raises(ValueError, match=r"budget must be a fraction in \(0, 1\] or a positive token count"):
        Budget.parse(value)


def test_counts_round_up_and_clip():
    assert Budget.parse(0.1).count(1000) == 100
    assert Budget.parse(0.1).count(31) == 4
    assert Budget.parse(0.1).count(30) == 3
    assert Budget.parse(0.001).count(10) == 1
    assert Budget.parse(5000).count(100) == 100
    assert Budget.parse(0.5).counts(torch.tensor([10, 3])).tolist() == [5, 2]
    with pytest.raises(ValueError, match="empty context"):
        Budget.parse(0.5).count(0)
