"""Retention and 95% intervals against hand-computed values."""

from __future__ import annotations

import math

import pytest

from kvfold.evaluate.scoring.stats import (
    TaskScores,
    macro_retention,
    macro_score,
    task_retention,
    task_score,
    wilson_interval,
)


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


def test_wilson_interval_for_3_of_8_by_hand() -> None:
    # p = 3/8 = 0.375, n = 8, z = 1.959964, z² = 3.841459:
    #   denominator = 1 + z²/n = 1 + 0.480182 = 1.480182
    #   centre = (p + z²/(2n)) / denominator = (0.375 + 0.240091) / 1.480182 = 0.415551
    #   half = z · sqrt(p(1-p)/n + z²/(4n²)) / denominator
    #        = 1.959964 · sqrt(0.029297 + 0.015006) / 1.480182 = 1.959964 · 0.210483 / 1.480182 = 0.278707
    #   → [0.136844, 0.694258] (a Wald interval would be 0.375 ± 0.335 = [0.040, 0.710])
    low, high = wilson_interval(3, 8)
    assert low == pytest.approx(0.136844, abs=1e-5) and high == pytest.approx(0.694258, abs=1e-5)
    interval = task_score(TaskScores(((100.0,),) * 3 + ((0.0,),) * 5))
    assert interval.value == 37.5
    assert interval.as_list() == pytest.approx([13.6844, 69.4258], abs=1e-3)


def test_task_score_of_clustered_pass_fail_questions_is_a_context_bootstrap() -> None:
    # Two contexts of two questions each: all right on one, all wrong on the other. Questions of one
    # context move together, so a draw of the 2 contexts has mean 0 (p = 1/4), 50 (1/2) or 100 (1/4):
    # the 2.5th and 97.5th percentiles are 0 and 100. Wilson for 2 of 4 independent trials would be
    # [15.0, 85.0] (centre 0.5, half-width 1.96 · sqrt(0.0625 + 0.0600) / 1.9604 = 0.350).
    interval = task_score(TaskScores(((100.0, 100.0), (0.0, 0.0))))
    assert interval.value == 50.0 and interval.as_list() == [0.0, 100.0]


def test_retention_interval_by_hand() -> None:
    # One of four single-question contexts is lost: a draw of 4 contexts keeps 4 - L of them, with
    # L ~ Binomial(4, 1/4). P(L = 4) = 1/256 = 0.4 % < 2.5 % ≤ P(L ≥ 3) = 13/256 = 5.1 %, so the
    # 2.5th percentile is retention 1/4; P(L = 0) = (3/4)^4 = 32 % > 2.5 %, so the 97.5th is 1.
    method = TaskScores(((100.0,), (0.0,), (100.0,), (100.0,)))
    full = TaskScores(((100.0,),) * 4)
    assert task_retention(method, full).as_list() == [0.25, 1.0]


def test_retention_draws_whole_contexts_for_method_and_full_together() -> None:
    # Per context the method keeps exactly half the full cache's score (100 of 200, 40 of 80), but
    # not per question (1, 0, 0, 1). Drawing whole contexts, paired, every draw is exactly 0.5;
    # drawing single questions, or the method and the full cache apart, spreads the interval.
    method = TaskScores(((100.0, 0.0), (0.0, 40.0)))
    full = TaskScores(((100.0, 100.0), (40.0, 40.0)))
    assert task_retention(method, full).value == 0.5
    assert task_retention(method, full).as_list() == pytest.approx([0.5, 0.5])


def test_macro_retention_interval_by_hand() -> None:
    # Each task is redrawn within itself (paired): every draw of a has method = full = 100, every draw
    # of b method 25 and full 50, so every draw's ratio of macro means is (100 + 25) / (100 + 50)
    # (a mean of per-task ratios would give (1 + 0.5) / 2 = 0.75).
    full = {"a": TaskScores(((100.0,),) * 4), "b": TaskScores(((50.0,),) * 4)}
    method = {"a": TaskScores(((100.0,),) * 4), "b": TaskScores(((25.0,),) * 4)}
    interval = macro_retention(method, full)
    assert [interval.value, *interval.as_list()] == pytest.approx([125 / 150] * 3)
    # the macro score of the method: (100 + 25) / 2, with the same stratified draws
    assert macro_score(method).value == 62.5 and macro_score(method).as_list() == pytest.approx([62.5, 62.5])


def test_a_task_with_one_context_has_no_bootstrap_interval() -> None:
    """Redrawing one context always gives its own mean: a [x, x] interval would claim certainty."""
    import math

    from kvfold.evaluate.scoring.stats import TaskScores, macro_retention, macro_score, task_retention, task_score

    one = TaskScores(((100.0, 0.0, 100.0, 100.0),))  # four questions about one context
    full = TaskScores(((100.0, 100.0, 100.0, 100.0),))
    assert task_score(one).value == 75.0 and math.isnan(task_score(one).low)
    assert task_retention(one, full).value == 0.75 and math.isnan(task_retention(one, full).high)
    two = TaskScores(((100.0,), (0.0,)))
    mixed = macro_score({"a": one, "b": two})
    assert mixed.value == 62.5 and math.isnan(mixed.low) and math.isnan(mixed.high)
    ret = macro_retention({"a": one, "b": two}, {"a": full, "b": TaskScores(((100.0,), (100.0,)))})
    assert ret.value == 0.625 and math.isnan(ret.low)
    single = TaskScores(((100.0,),))  # one pass/fail question: Wilson still applies
    assert task_score(single).low > 0 and task_score(single).high == 100.0


def test_a_paired_difference_draws_the_same_contexts_for_both_methods() -> None:
    from kvfold.evaluate.scoring.stats import retention_difference

    # the second method solves a subset of what the first solves: every draw's difference is ≥ 0
    first = {"t": TaskScores(tuple((100.0,) if i < 8 else (0.0,) for i in range(12)))}
    second = {"t": TaskScores(tuple((100.0,) if i < 6 else (0.0,) for i in range(12)))}
    full = {"t": TaskScores(tuple((100.0,) for _ in range(12)))}
    diff = retention_difference(first, second, full)
    assert diff.value == pytest.approx(2 / 12)
    assert diff.low >= 0  # unpaired draws would reach below 0 on these scores
    same = retention_difference(first, first, full)
    assert same.value == 0 and same.low == 0 and same.high == 0
    with pytest.raises(ValueError, match="same tasks"):
        retention_difference(first, {"u": second["t"]}, full)
