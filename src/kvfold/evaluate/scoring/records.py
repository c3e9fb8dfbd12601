"""From prediction rows to result records: scores and retention per task and averaged, with intervals.

A sweep (:mod:`kvfold.evaluate.running.runner`) writes one prediction row per sample × method ×
budget; :func:`aggregate` turns them into the records of ``results.json``: one per (method,
budget, task) and average rows per (method, budget), with the 95% intervals of
:mod:`kvfold.evaluate.scoring.stats` (docs/evaluation.md, "Retention and intervals": the headline
is retention on the tasks the full cache solves).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from kvfold.evaluate.scoring.stats import (
    Interval,
    TaskScores,
    macro_retention,
    macro_score,
    retention_difference,
    task_retention,
    task_score,
)
from kvfold.methods import build_method
from kvfold.runtime.errors import UserError

__all__ = [
    "AVERAGE_TASK",
    "HEADLINE_MIN_FULL_SCORE",
    "HEADLINE_TASK",
    "SUMMARY_TASKS",
    "aggregate",
    "headline_difference",
    "names_full",
]

AVERAGE_TASK = "average"
HEADLINE_TASK = "headline"
SUMMARY_TASKS = (AVERAGE_TASK, HEADLINE_TASK, f"{HEADLINE_TASK}_noise", f"{HEADLINE_TASK}_prose")
"""The task names of average rows (see :func:`aggregate`)."""

HEADLINE_MIN_FULL_SCORE = 50.0
"""A task whose full-cache score is below this says nothing about compression: it is reported
apart and left out of the headline average."""


def names_full(label: str) -> bool:
    """Whether a result's method label is the uncompressed cache (False for labels of no method)."""
    try:
        return build_method(label).is_lossless
    except ValueError:
        return False


def memory_ratio(prediction: Mapping[str, Any]) -> float:
    """A prediction's cache bytes over the 16-bit full cache's (``memory_ratio``); rows written
    before that field existed held unquantized caches, whose ratio is their ``kv_bytes`` ratio."""
    if prediction.get("memory_ratio") is not None:
        return float(prediction["memory_ratio"])
    return prediction["kv_bytes"] / prediction["kv_bytes_full"]


def _task_scores(preds: Sequence[Mapping[str, Any]]) -> TaskScores:
    ordered = sorted(preds, key=lambda p: p.get("sample_id", ""))
    return TaskScores.from_pairs(
        [(p.get("context_id") or p.get("sample_id") or str(i), p["score"]) for i, p in enumerate(ordered)]
    )


def _interval_fields(prefix: str, interval: Interval | None, scale: float = 1.0) -> dict[str, Any]:
    """``{prefix: value, prefix_ci: [low, high]}``; undefined numbers become None (JSON null)."""

    def number(x: float) -> float | None:
        return None if math.isnan(x) else x * scale

    if interval is None or math.isnan(interval.value):
        return {prefix: None, f"{prefix}_ci": None}
    ci = [number(interval.low), number(interval.high)]
    return {prefix: number(interval.value), f"{prefix}_ci": None if None in ci else ci}


def _full_predictions(predictions: Sequence[Mapping[str, Any]]) -> dict[tuple[bool, str], dict[str, Mapping[str, Any]]]:
    """The full cache's predictions by (query_aware, task), keyed by sample id."""
    full: dict[tuple[bool, str], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for p in predictions:
        if names_full(p["method"]) and "sample_id" in p:
            full[(bool(p["query_aware"]), p["task"])][p["sample_id"]] = p
    return full


def _paired_full(preds: Sequence[Mapping[str, Any]], full: Mapping[str, Mapping[str, Any]]) -> TaskScores | None:
    """The full cache's scores on exactly these samples, or None if it did not answer all of them.

    They are grouped by the method's context ids, so the two sides pair up even when one side's
    rows were written without ``context_id`` (predictions from before it existed, on resume).
    """
    if not full or any(p.get("sample_id") not in full for p in preds):
        return None
    return _task_scores([{**full[p["sample_id"]], "context_id": p.get("context_id")} for p in preds])


def aggregate(predictions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records per (method, budget, task) and average rows per (method, budget).

    Per task: ``score`` (mean per-sample score, 0-100) with ``score_ci`` (95%), ``retention``
    (score / the full cache's score on the same samples, a fraction) with ``retention_ci``, when a
    ``full`` run answered the same samples; ``headline`` (the full cache scores at least
    :data:`HEADLINE_MIN_FULL_SCORE` on the task, or no ``full`` run to tell); ``haystack``;
    ``kv_ratio`` (mean compressed / full bytes); ``compress_over_prefill`` (mean compression
    seconds over the prefill seconds of the same context); other metric names hold their means.

    Averages (macro: each task weighs the same; intervals by a stratified paired bootstrap over
    contexts, see :mod:`kvfold.evaluate.scoring.stats`): ``"average"`` over every task, ``"headline"``
    over the headline tasks, ``"headline_noise"`` / ``"headline_prose"`` over the headline tasks
    of each haystack (a row is left out when it would cover no task). An average row lists its
    ``tasks``.
    """
    groups: dict[tuple[str, Any, bool], dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in predictions:
        groups[(p["method"], p["budget"], bool(p["query_aware"]))][p["task"]].append(p)
    full_by_task = _full_predictions(predictions)
    full_scores = {key: _task_scores(list(rows.values())).mean() for key, rows in full_by_task.items() if rows}
    records = []
    for (method, budget, query_aware), tasks in groups.items():
        rows = []
        method_scores: dict[str, TaskScores] = {}
        paired_full: dict[str, TaskScores | None] = {}
        for task, preds in tasks.items():
            scores = _task_scores(preds)
            full = _paired_full(preds, full_by_task.get((query_aware, task), {}))
            method_scores[task], paired_full[task] = scores, full
            row = {"method": method, "budget": budget, "task": task}
            row.update(_task_measures(preds, scores, full, full_scores.get((query_aware, task)), query_aware))
            rows.append(row)
        records.extend([*rows, *_averages(method, budget, query_aware, rows, method_scores, paired_full)])
    return records


def _task_measures(
    preds: Sequence[Mapping[str, Any]],
    scores: TaskScores,
    full: TaskScores | None,
    full_score: float | None,
    query_aware: bool,
) -> dict[str, Any]:
    """The measures of one (method, budget, task) record, after its ``method``, ``budget``, ``task``."""
    row = {
        **_interval_fields("score", task_score(scores)),
        **_interval_fields("retention", task_retention(scores, full) if full is not None else None),
        "n": len(preds),
        "contexts": len(scores.contexts),
        "headline": full_score is None or full_score >= HEADLINE_MIN_FULL_SCORE,
        "haystack": preds[0].get("haystack"),
        "query_aware": query_aware,
        "kv_ratio": _mean(p["kv_bytes"] / p["kv_bytes_full"] for p in preds),
        "kv_bytes": _mean(p["kv_bytes"] for p in preds),
        "memory": preds[0].get("memory"),
        "memory_ratio": _mean(memory_ratio(p) for p in preds),
        "kv_format": preds[0].get("kv_format", "16"),
        "compress_over_prefill": _mean(
            p["compress_seconds"] / p["prefill_seconds"] for p in preds if p.get("prefill_seconds")
        ),
    }
    names = dict.fromkeys(name for p in preds for name in p.get("metrics", {}))
    row.update({name: _mean(p["metrics"][name] for p in preds if name in p.get("metrics", {})) for name in names})
    return row


def _averages(
    method: str,
    budget: Any,
    query_aware: bool,
    rows: Sequence[Mapping[str, Any]],
    method_scores: Mapping[str, TaskScores],
    paired_full: Mapping[str, TaskScores | None],
) -> list[dict[str, Any]]:
    """The average rows of one (method, budget): over every task, the headline tasks, and each haystack."""
    headline = [r for r in rows if r["headline"]]
    selections = {
        AVERAGE_TASK: rows,
        HEADLINE_TASK: headline,
        f"{HEADLINE_TASK}_noise": [r for r in headline if r["haystack"] == "noise"],
        f"{HEADLINE_TASK}_prose": [r for r in headline if r["haystack"] == "prose"],
    }
    averages = []
    for name, chosen in selections.items():
        if not chosen:
            continue
        names = [r["task"] for r in chosen]
        fulls = {t: paired_full[t] for t in names}
        retention = (
            macro_retention({t: method_scores[t] for t in names}, fulls)  # type: ignore[arg-type]
            if all(f is not None for f in fulls.values())
            else None
        )
        averages.append(
            {
                "method": method,
                "budget": budget,
                "task": name,
                **_interval_fields("score", macro_score({t: method_scores[t] for t in names})),
                **_interval_fields("retention", retention),
                "n": sum(r["n"] for r in chosen),
                "contexts": sum(r["contexts"] for r in chosen),
                "tasks": names,
                "query_aware": query_aware,
                "kv_ratio": _mean(r["kv_ratio"] for r in chosen),
                "memory": chosen[0].get("memory"),
                "memory_ratio": _mean(r.get("memory_ratio", r["kv_ratio"]) for r in chosen),
                "kv_format": chosen[0].get("kv_format", "16"),
                "compress_over_prefill": _mean(r["compress_over_prefill"] for r in chosen),
            }
        )
    return averages


def _mean(values: Any) -> float:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else float("nan")


def headline_difference(
    predictions: Sequence[Mapping[str, Any]], first: tuple[str, Any], second: tuple[str, Any]
) -> tuple[Interval, list[str]]:
    """Headline retention of ``first`` minus ``second`` (each a ``(method, budget)`` as the
    prediction rows name them), with the paired interval of
    :func:`kvfold.evaluate.scoring.stats.retention_difference`, over the headline tasks (the full
    cache scores at least :data:`HEADLINE_MIN_FULL_SCORE`) that both answered on the same samples.

    Returns:
        The difference (fractions) and the tasks it covers.

    Raises:
        ValueError: one side has no predictions, or no full cache answered their samples.
    """
    sides: list[dict[str, list[Mapping[str, Any]]]] = []
    for method, budget in (first, second):
        rows: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for p in predictions:
            if p["method"] == method and p["budget"] == budget and not p["query_aware"]:
                rows[p["task"]].append(p)
        if not rows:
            raise UserError(f"no query-agnostic predictions of {method} at {budget}")
        sides.append(rows)
    full_by_task = _full_predictions(predictions)
    chosen: dict[str, tuple[TaskScores, TaskScores, TaskScores]] = {}
    for task in sorted(set(sides[0]) & set(sides[1])):
        a, b = sides[0][task], sides[1][task]
        if {p["sample_id"] for p in a} != {p["sample_id"] for p in b}:
            continue
        full = _paired_full(a, full_by_task.get((False, task), {}))
        if full is None or full.mean() < HEADLINE_MIN_FULL_SCORE:
            continue
        chosen[task] = (_task_scores(a), _task_scores(b), full)
    if not chosen:
        raise UserError("no headline task where both sides and the full cache answered the same samples")
    interval = retention_difference(
        {t: v[0] for t, v in chosen.items()}, {t: v[1] for t, v in chosen.items()}, {t: v[2] for t, v in chosen.items()}
    )
    return interval, sorted(chosen)
