"""The RULER task plans: common-words frequencies, and a plan's context grows with its unit count."""

from __future__ import annotations

from kvfold.evaluate.data.ruler_tasks import NIAH_CONFIGS, cwe_frequencies, plan_cwe, plan_niah


def test_cwe_frequencies_keep_the_contrast() -> None:
    assert cwe_frequencies(2000, 1500) == (30, 3)  # RULER's setting
    assert cwe_frequencies(100, 1500) == (5, 1)  # short lists scale down
    common, rare = cwe_frequencies(100_000, 1500)  # long lists run out of distinct rare words
    assert common >= 3 * rare and 10 * common + rare * 1500 >= 100_000


def test_a_plan_builds_longer_contexts_from_more_units_with_the_same_questions() -> None:
    for make in (lambda: plan_niah(NIAH_CONFIGS["niah_single_2"], "seed"), lambda: plan_cwe("seed")):
        plan = make()
        assert len(plan.build(120)) > len(plan.build(60))
        assert plan.questions == make().questions  # a plan depends only on its seed
