"""Retention and 95% intervals: how much of the full cache's score a method keeps, and how sure we are.

The headline of an evaluation (docs/evaluation.md, "Retention and intervals": on the tasks the full
cache solves) is **retention**: a method's score divided by the full cache's score on
the *same* samples. Both come with a 95% interval:

* the score of a task whose per-sample scores are all 0 or 100 (a needle found or not) gets the
  Wilson score interval (Wilson 1927), which stays inside [0, 100] and is sensible at 0/n and n/n;
  a task with partial credit gets a percentile bootstrap interval;
* retention, and every average over tasks, get a **paired cluster bootstrap**: samples are drawn
  with replacement by *context* (questions that share a context are correlated and move
  together), the method and the full cache are scored on the same draw, and the ratio of their
  means is taken. An average over tasks resamples within each task (stratified), so every task
  keeps its weight.

Intervals are percentile intervals of ``DEFAULT_RESAMPLES`` draws from a fixed seed, so a report is
reproducible. Two methods differ only when their intervals do not overlap. A bootstrap interval
needs at least :data:`MIN_CONTEXTS` contexts in every task it resamples: redrawing a task's one
context always gives the same mean, and the interval would claim a certainty the run does not have,
so it is left undefined (``nan``, shown as "–" and written as ``null``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_RESAMPLES",
    "Interval",
    "TaskScores",
    "macro_retention",
    "macro_score",
    "task_retention",
    "task_score",
    "wilson_interval",
]

DEFAULT_RESAMPLES = 2000
"""Bootstrap draws per interval."""

MIN_CONTEXTS = 2
"""Contexts a task needs before a bootstrap over its contexts says anything about its spread."""

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% interval; ``low``/``high`` are ``nan`` when undefined."""

    value: float
    low: float
    high: float

    def as_list(self) -> list[float]:
        """``[low, high]`` for JSON records."""
        return [self.low, self.high]


@dataclass(frozen=True)
class TaskScores:
    """One task's per-sample scores (0-100), grouped by the context each sample was asked about.

    Attributes:
        contexts: one tuple of sample scores per context (a context may carry several questions).
    """

    contexts: tuple[tuple[float, ...], ...]

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, float]]) -> TaskScores:
        """Scores from ``(context_key, score)`` pairs, grouped by context in first-seen order."""
        groups: dict[str, list[float]] = {}
        for key, value in pairs:
            groups.setdefault(key, []).append(float(value))
        return cls(tuple(tuple(v) for v in groups.values()))

    @property
    def values(self) -> list[float]:
        """All sample scores, context by context."""
        return [v for context in self.contexts for v in context]

    def mean(self) -> float:
        """The mean sample score (``nan`` with no samples)."""
        values = self.values
        return sum(values) / len(values) if values else math.nan


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion, as fractions in [0, 1].

    Args:
        successes: number of successes (0 ≤ successes ≤ n).
        n: number of trials.
        z: normal quantile (1.96 for 95%).

    Returns:
        ``(low, high)``; ``(nan, nan)`` when ``n == 0``.

    Example:
        >>> [round(x, 4) for x in wilson_interval(8, 10)]
        [0.4902, 0.9433]
    """
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n]; got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def _percentiles(draws: np.ndarray) -> tuple[float, float]:
    finite = draws[np.isfinite(draws)]
    if finite.size < max(10, draws.size // 2):  # mostly undefined (e.g. the full cache scored 0)
        return math.nan, math.nan
    low, high = np.percentile(finite, [2.5, 97.5])
    return float(low), float(high)


def _context_sums(scores: TaskScores) -> tuple[np.ndarray, np.ndarray]:
    """Per-context score sums and question counts."""
    sums = np.array([sum(c) for c in scores.contexts], dtype=np.float64)
    counts = np.array([len(c) for c in scores.contexts], dtype=np.float64)
    return sums, counts


def _draws(sizes: Sequence[int], resamples: int, seed: int) -> list[np.ndarray]:
    """Resampling indices, one ``(resamples, n)`` matrix per stratum of ``n`` contexts."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(resamples, n)) if n else np.zeros((resamples, 0), int) for n in sizes]


def _resampled_means(sums: np.ndarray, counts: np.ndarray, index: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[index].sum(axis=1) / counts[index].sum(axis=1)


def _ratio(method_mean: np.ndarray | float, full_mean: np.ndarray | float) -> np.ndarray | float:
    with np.errstate(invalid="ignore", divide="ignore"):
        if isinstance(full_mean, np.ndarray):
            return np.where(full_mean > 0, method_mean / np.where(full_mean > 0, full_mean, 1.0), np.nan)
        return method_mean / full_mean if full_mean > 0 else math.nan


def task_score(scores: TaskScores, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval:
    """A task's mean score (0-100) with its 95% interval.

    Wilson when every sample scores 0 or 100 and no context carries several questions (independent
    Bernoulli trials); otherwise a bootstrap over contexts.
    """
    values = scores.values
    if not values:
        return Interval(math.nan, math.nan, math.nan)
    mean = scores.mean()
    if all(v in (0.0, 100.0) for v in values) and all(len(c) == 1 for c in scores.contexts):
        low, high = wilson_interval(sum(v == 100.0 for v in values), len(values))
        return Interval(mean, 100 * low, 100 * high)
    sums, counts = _context_sums(scores)
    if len(sums) < MIN_CONTEXTS:
        return Interval(mean, math.nan, math.nan)
    (index,) = _draws([len(sums)], resamples, seed)
    return Interval(mean, *_percentiles(_resampled_means(sums, counts, index)))


def _check_paired(method: TaskScores, full: TaskScores) -> None:
    if [len(c) for c in method.contexts] != [len(c) for c in full.contexts]:
        raise ValueError("retention needs the method and the full cache scored on the same samples")


def task_retention(method: TaskScores, full: TaskScores, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval:
    """Retention (score / full-cache score on the same samples, as a fraction) with its interval.

    Args:
        method: the method's scores.
        full: the full cache's scores on the same contexts and questions, in the same order.

    Returns:
        The retention (``nan`` when the full cache scores 0) and its paired bootstrap interval
        over contexts (the method and the full cache are redrawn together).

    Example:
        >>> m = TaskScores(((100.0,), (0.0,), (100.0,), (100.0,)))
        >>> f = TaskScores(((100.0,), (100.0,), (100.0,), (100.0,)))
        >>> task_retention(m, f).value
        0.75
    """
    return macro_retention({"task": method}, {"task": full}, resamples, seed)


def _macro_draws(tasks: Sequence[TaskScores], indices: Sequence[np.ndarray]) -> np.ndarray:
    per_task = [_resampled_means(*_context_sums(t), i) for t, i in zip(tasks, indices, strict=True)]
    return np.mean(per_task, axis=0)


def macro_score(tasks: Mapping[str, TaskScores], resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval:
    """The macro average score over tasks (each task weighs the same) with a stratified interval."""
    ordered = [tasks[t] for t in sorted(tasks)]
    if not ordered:
        return Interval(math.nan, math.nan, math.nan)
    value = float(np.mean([t.mean() for t in ordered]))
    if min(len(t.contexts) for t in ordered) < MIN_CONTEXTS:
        return Interval(value, math.nan, math.nan)
    indices = _draws([len(t.contexts) for t in ordered], resamples, seed)
    return Interval(value, *_percentiles(_macro_draws(ordered, indices)))


def macro_retention(
    method: Mapping[str, TaskScores],
    full: Mapping[str, TaskScores],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Retention of the macro average: the method's macro score over the full cache's, same tasks.

    Each task is redrawn by context within itself (stratified), with the same draw for the method
    and the full cache (paired).

    Raises:
        ValueError: the two sides do not cover the same tasks and samples.
    """
    if set(method) != set(full):
        raise ValueError(f"retention needs the same tasks; method has {sorted(method)}, full has {sorted(full)}")
    tasks = sorted(method)
    if not tasks:
        return Interval(math.nan, math.nan, math.nan)
    for t in tasks:
        _check_paired(method[t], full[t])
    value = _ratio(float(np.mean([method[t].mean() for t in tasks])), float(np.mean([full[t].mean() for t in tasks])))
    if min(len(full[t].contexts) for t in tasks) < MIN_CONTEXTS:
        return Interval(float(value), math.nan, math.nan)
    indices = _draws([len(full[t].contexts) for t in tasks], resamples, seed)
    draws = _ratio(_macro_draws([method[t] for t in tasks], indices), _macro_draws([full[t] for t in tasks], indices))
    return Interval(float(value), *_percentiles(np.asarray(draws)))


def retention_difference(
    first: Mapping[str, TaskScores],
    second: Mapping[str, TaskScores],
    full: Mapping[str, TaskScores],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The macro retention of ``first`` minus that of ``second`` (fractions), with a **paired**
    interval: both methods and the full cache were scored on the same contexts, and every draw
    takes the same contexts for all three (stratified by task, as :func:`macro_retention`). The
    difference is beyond the interval's noise when the interval excludes 0.

    Raises:
        ValueError: the three sides do not cover the same tasks and samples.

    Example:
        >>> a = {"t": TaskScores(((100.0,), (100.0,), (100.0,), (0.0,)))}
        >>> b = {"t": TaskScores(((100.0,), (0.0,), (0.0,), (0.0,)))}
        >>> f = {"t": TaskScores(((100.0,), (100.0,), (100.0,), (100.0,)))}
        >>> retention_difference(a, b, f).value
        0.5
    """
    if not set(first) == set(second) == set(full):
        raise ValueError("a paired difference needs the same tasks on both sides and the full cache")
    tasks = sorted(full)
    if not tasks:
        return Interval(math.nan, math.nan, math.nan)
    for t in tasks:
        _check_paired(first[t], full[t])
        _check_paired(second[t], full[t])
    full_mean = float(np.mean([full[t].mean() for t in tasks]))
    value = _ratio(float(np.mean([first[t].mean() for t in tasks])), full_mean) - _ratio(
        float(np.mean([second[t].mean() for t in tasks])), full_mean
    )
    if min(len(full[t].contexts) for t in tasks) < MIN_CONTEXTS:
        return Interval(float(value), math.nan, math.nan)
    indices = _draws([len(full[t].contexts) for t in tasks], resamples, seed)
    full_draws = _macro_draws([full[t] for t in tasks], indices)
    draws = _ratio(_macro_draws([first[t] for t in tasks], indices), full_draws) - _ratio(
        _macro_draws([second[t] for t in tasks], indices), full_draws
    )
    return Interval(float(value), *_percentiles(np.asarray(draws)))
