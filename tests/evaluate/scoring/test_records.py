"""Result records from prediction rows: macro averages, retention paired with the full cache, context clusters."""

from __future__ import annotations

import pytest

from kvfold.evaluate.scoring.records import aggregate, names_full


def test_aggregate_macro_average() -> None:
    def pred(task: str, score: float) -> dict:
        return {
            "method": "m",
            "budget": 0.5,
            "query_aware": False,
            "task": task,
            "score": score,
            "kv_bytes": 1,
            "kv_bytes_full": 4,
        }

    records = aggregate([pred("a", 100.0), pred("a", 100.0), pred("a", 100.0), pred("b", 0.0)])
    average = next(r for r in records if r["task"] == "average")
    assert average["score"] == 50.0 and average["n"] == 4
    assert average["kv_ratio"] == 0.25
    # no full run: nothing tells which tasks it solves, so every task is in the headline, no retention
    headline = next(r for r in records if r["task"] == "headline")
    assert headline["tasks"] == ["a", "b"] and headline["retention"] is None


def test_aggregate_retention_pairs_samples_with_the_full_cache() -> None:
    def pred(method: str, task: str, index: int, score: float) -> dict:
        budget = 1.0 if method == "full" else 0.1
        return {"method": method, "budget": budget, "query_aware": False, "task": task, "score": score,
                "sample_id": f"{task}/{index}", "kv_bytes": 1, "kv_bytes_full": 1, "haystack": "prose"}  # fmt: skip

    full = [pred("full", "a", i, 100.0) for i in range(4)]
    full += [pred("full", "b", i, s) for i, s in enumerate([100.0, 0, 0, 0])]
    snap = [pred("snapkv", "a", i, s) for i, s in enumerate([100.0, 100.0, 0.0, 100.0])]
    snap += [pred("snapkv", "b", i, 100.0) for i in range(4)]
    records = {(r["method"], r["task"]): r for r in aggregate(full + snap)}
    task_a = records[("snapkv", "a")]
    assert task_a["retention"] == 0.75 and task_a["headline"] is True
    low, high = task_a["retention_ci"]
    assert 0.0 <= low < 0.75 < high <= 1.0
    assert records[("snapkv", "b")]["headline"] is False  # the full cache scores 25 on b
    headline = records[("snapkv", "headline")]
    assert headline["tasks"] == ["a"] and headline["retention"] == 0.75
    assert records[("snapkv", "headline_prose")]["retention"] == 0.75
    assert ("snapkv", "headline_noise") not in records
    assert records[("snapkv", "average")]["score"] == (75.0 + 100.0) / 2


def _scored(method: str, task: str, sample_id: str, score: float, context_id: str | None = None) -> dict:
    row = {"method": method, "budget": 1.0 if method == "full" else 0.1, "query_aware": False, "task": task,
           "score": score, "sample_id": sample_id, "kv_bytes": 1, "kv_bytes_full": 1, "haystack": "noise"}  # fmt: skip
    return row if context_id is None else {**row, "context_id": context_id}


def test_aggregate_clusters_retention_by_context() -> None:
    # Two contexts of two questions. Per context the method keeps exactly half the full cache's score
    # (100 of 200, 40 of 80) but not per question, so only draws of whole contexts (by context_id),
    # paired with the full cache, make every bootstrap draw 0.5.
    scores = {"t/0/q0": (100.0, 100.0, "c0"), "t/0/q1": (0.0, 100.0, "c0"),
              "t/1/q0": (0.0, 40.0, "c1"), "t/1/q1": (40.0, 40.0, "c1")}  # fmt: skip
    rows = [_scored("snapkv", "t", sid, m, c) for sid, (m, _, c) in scores.items()]
    rows += [_scored("full", "t", sid, f, c) for sid, (_, f, c) in scores.items()]
    records = {(r["method"], r["task"]): r for r in aggregate(rows)}
    task = records[("snapkv", "t")]
    assert task["contexts"] == 2 and task["n"] == 4
    assert task["retention"] == 0.5 and task["retention_ci"] == pytest.approx([0.5, 0.5])
    assert records[("snapkv", "headline")]["retention_ci"] == pytest.approx([0.5, 0.5])
    # the score interval is drawn by context too: the full cache's draws have means 100, 70 or 40
    assert records[("full", "t")]["score_ci"] == [40.0, 100.0]


def test_aggregate_retention_divides_by_the_full_score_on_the_same_samples() -> None:
    # The full cache answered four samples (mean 50); the method only the first two (an interrupted
    # sweep). Retention is 50 / 100 on those two, not 50 / 50 over the full cache's four.
    full = [_scored("full", "t", f"t/{i}", s) for i, s in enumerate([100.0, 100.0, 0.0, 0.0])]
    method = [_scored("snapkv", "t", "t/0", 100.0), _scored("snapkv", "t", "t/1", 0.0)]
    records = {(r["method"], r["task"]): r for r in aggregate(full + method)}
    assert records[("snapkv", "t")]["retention"] == 0.5
    assert records[("snapkv", "t")]["headline"] is True  # the full cache scores 50 on the task: kept
    assert records[("snapkv", "headline")]["retention"] == 0.5


def test_aggregate_pairs_with_full_predictions_written_without_context_ids() -> None:
    # A sweep resumed after an upgrade: the full cache's rows predate context_id, the method's have
    # it. The full cache is clustered like the method (same samples, same contexts), not refused.
    full = [_scored("full", "t", sid, 100.0) for sid in ("t/0/q0", "t/0/q1", "t/1")]
    method = [_scored("snapkv", "t", "t/0/q0", 100.0, "c0"), _scored("snapkv", "t", "t/0/q1", 0.0, "c0"),
              _scored("snapkv", "t", "t/1", 100.0, "c1")]  # fmt: skip
    records = {(r["method"], r["task"]): r for r in aggregate(full + method)}
    task = records[("snapkv", "t")]
    assert task["retention"] == pytest.approx(2 / 3) and task["contexts"] == 2
    # two contexts redrawn: both c0 (retention 1/2, p = 1/4), both c1 (1, p = 1/4) or one each (2/3)
    assert task["retention_ci"] == pytest.approx([0.5, 1.0])


def test_names_full_knows_the_uncompressed_cache_and_no_other_label() -> None:
    assert names_full("full") and not names_full("snapkv") and not names_full("not a method")


def test_headline_difference_pairs_two_methods_on_the_samples_the_full_cache_answered() -> None:
    from kvfold.evaluate.scoring.records import headline_difference

    rows = []
    for i in range(10):
        for method, score in (("full", 100.0), ("a", 100.0 if i < 9 else 0.0), ("b", 100.0 if i < 5 else 0.0)):
            budget = 1.0 if method == "full" else 0.03125
            rows.append(
                {"sample_id": f"s{i}", "context_id": f"c{i}", "task": "niah", "method": method, "budget": budget,
                 "query_aware": False, "score": score}
            )  # fmt: skip
    interval, tasks = headline_difference(rows, ("a", 0.03125), ("b", 0.03125))
    assert tasks == ["niah"] and interval.value == pytest.approx(0.4) and interval.low > 0
    with pytest.raises(ValueError, match="no query-agnostic predictions"):
        headline_difference(rows, ("a", 0.5), ("b", 0.03125))
