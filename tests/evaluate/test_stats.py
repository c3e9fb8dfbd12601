"""Retention and 95% intervals against hand-computed values."""

from __future__ import annotations

import math

import pytest

from kvfold.evaluate.stats import TaskScores, macro_retention, macro_score, task_retention, task_score, wilson_interval


def test_wilson_interval_matches_the_formula() -> None:
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416, half-width 1.96 * sqrt(0.016 + 0.00096) / 1.38416
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 5)[0] == 0.0 and 0.4 < wilson_interval(0, 5)[1] < 0.5
    assert wilson_interval(5, 5)[1] == 1.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(6, 5)


def test_task_score_uses_wilson_for_pass_fail_samples() -> None:
    scores = TaskScores(tuple((100.0,) if i < 8 else (0.0,) for i in range(10)))
    interval = task_score(scores)
    assert interval.value == 80.0
    assert interval.low == pytest.approx(49.02, abs=0.01) and interval.high == pytest.approx(94.33, abs=0.01)


def test_task_score_bootstraps_partial_credit_by_context() -> None:
    constant = TaskScores(((50.0, 50.0), (50.0,), (50.0,)))
    assert task_score(constant).as_list() == [50.0, 50.0]
    spread = task_score(TaskScores(((0.0, 50.0), (100.0,), (75.0,), (25.0,))))
    assert spread.value == 50.0 and 0.0 <= spread.low < 50.0 < spread.high <= 100.0


def test_retention_is_the_ratio_on_the_same_samples() -> None:
    method = TaskScores(((100.0,), (0.0,), (100.0,), (100.0,)))
    full = TaskScores(((100.0,), (100.0,), (100.0,), (100.0,)))
    interval = task_retention(method, full)
    assert interval.value == 0.75
    # four contexts: the bootstrap can draw 0 to 4 copies of the lost one, so 0.0 .. 1.0 are the extremes
    assert 0.0 <= interval.low <= 0.5 and interval.high == 1.0
    assert task_retention(full, full).as_list() == [1.0, 1.0]
    assert math.isnan(task_retention(method, TaskScores(((0.0,), (0.0,), (0.0,), (0.0,)))).value)


def test_retention_draws_method_and_full_together() -> None:
    # The method always scores half the full cache on the same context: paired draws give exactly 0.5.
    full = TaskScores(((100.0,), (50.0,), (80.0,), (20.0,)))
    method = TaskScores(((50.0,), (25.0,), (40.0,), (10.0,)))
    assert task_retention(method, full).as_list() == pytest.approx([0.5, 0.5])


def test_macro_average_weighs_tasks_equally() -> None:
    tasks = {"a": TaskScores(((100.0,),) * 9), "b": TaskScores(((0.0,),))}
    assert macro_score(tasks).value == 50.0
    full = {"a": TaskScores(((100.0,),) * 4), "b": TaskScores(((50.0,),) * 4)}
    method = {"a": TaskScores(((100.0,),) * 4), "b": TaskScores(((25.0,),) * 4)}
    assert macro_retention(method, full).value == pytest.approx((100 + 25) / (100 + 50))
    with pytest.raises(ValueError, match="same tasks"):
        macro_retention({"a": method["a"]}, full)
    with pytest.raises(ValueError, match="same samples"):
        task_retention(TaskScores(((1.0,),)), TaskScores(((1.0,), (2.0,))))
