"""How concentrated a load is over the retained entries of a cache: Gini, top shares, Lorenz curves.

The measures of :mod:`kvfold.evaluate.diagnostics.mergemap` (GRKV, ``papers/grkv.md``, §1 and
Appendix A): the **carrier load** ``ℓ_i`` of each retained entry (how many evicted tokens it
absorbed; eq. 14: ``max ℓ ≥ ⌈e/b⌉``) and the **update magnitude** ``‖Δk_i‖``, ``‖Δv_i‖`` of each
retained entry against its uncompressed self, with how much of either the most loaded entries,
and the first and last entries of retained spans, take.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "CHANGED_TOL",
    "LORENZ_POINTS",
    "carrier_load",
    "gini",
    "lorenz_curve",
    "span_boundaries",
    "top_share",
    "update_load",
]

LORENZ_POINTS = 101
"""Points of a Lorenz-style curve (:func:`lorenz_curve`)."""

CHANGED_TOL = 1e-6
"""A retained entry counts as updated when ‖Δ‖ exceeds this fraction of its norm."""


def gini(load: np.ndarray) -> float:
    """Gini coefficient of non-negative loads: 0 = all equal, ``(n−1)/n`` = all on one entry."""
    x = np.sort(np.asarray(load, dtype=np.float64))
    n, total = x.size, x.sum()
    if n == 0 or total <= 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float(2.0 * (ranks * x).sum() / (n * total) - (n + 1) / n)


def top_share(load: np.ndarray, fraction: float) -> float:
    """Share of the total load held by the ``⌈fraction · n⌉`` most loaded entries."""
    x = np.sort(np.asarray(load, dtype=np.float64))[::-1]
    total = x.sum()
    if x.size == 0 or total <= 0:
        return 0.0
    return float(x[: max(1, math.ceil(fraction * x.size - 1e-9))].sum() / total)


def lorenz_curve(load: np.ndarray, points: int = LORENZ_POINTS) -> np.ndarray:
    """Top-``q`` share of the load at ``q = 0, 1/(points−1), …, 1`` (entries sorted by load, largest first)."""
    x = np.sort(np.asarray(load, dtype=np.float64))[::-1]
    grid = np.linspace(0.0, 1.0, points)
    if x.size == 0 or x.sum() <= 0:
        return np.full(points, np.nan)
    cumulative = np.concatenate([[0.0], np.cumsum(x) / x.sum()])
    return np.interp(grid * x.size, np.arange(x.size + 1), cumulative)


def span_boundaries(positions: np.ndarray) -> np.ndarray:
    """Bool per retained position (sorted ascending): first or last entry of a run of consecutive positions."""
    p = np.asarray(positions)
    if p.size == 0:
        return np.zeros(0, dtype=bool)
    starts = np.ones(p.size, dtype=bool)
    starts[1:] = np.diff(p) != 1
    ends = np.ones(p.size, dtype=bool)
    ends[:-1] = np.diff(p) != 1
    return starts | ends


def carrier_load(retained: np.ndarray, carriers: np.ndarray, shares: np.ndarray, evicted: int) -> dict[str, float]:
    """Concentration of the merges of one layer and head on its retained entries.

    Args:
        retained: ``(c,)`` positions of the retained entries, ascending.
        carriers: ``(M,)`` carrier position of every recorded pair (each in ``retained``).
        shares: ``(M,)`` share of the absorbed token given to that carrier.
        evicted: tokens evicted in this head (``e``).

    Returns:
        ``absorbed`` (Σ shares), ``merged_fraction`` (absorbed / e), ``active`` (share of retained
        entries with a load), ``top1_share``, ``top10_share``, ``gini``, ``max_load``,
        ``max_over_mean`` (largest load / mean load over all retained entries), ``boundary_share``
        (load on span-boundary entries) and ``boundary_fraction`` (boundary entries / c).
    """
    retained = np.asarray(retained)
    index = np.searchsorted(retained, carriers)
    if index.size and (index.max() >= retained.size or not np.array_equal(retained[index], carriers)):
        raise ValueError("a recorded carrier is not among the retained entries")
    load = np.bincount(index, weights=shares, minlength=retained.size).astype(np.float64)
    total = float(load.sum())
    boundary = span_boundaries(retained)
    mean = total / max(retained.size, 1)
    return {
        "absorbed": total,
        "merged_fraction": total / evicted if evicted else 0.0,
        "active": float((load > 0).mean()) if load.size else 0.0,
        "top1_share": top_share(load, 0.01),
        "top10_share": top_share(load, 0.1),
        "gini": gini(load),
        "max_load": float(load.max()) if load.size else 0.0,
        "max_over_mean": float(load.max() / mean) if mean > 0 else 0.0,
        "boundary_share": float(load[boundary].sum() / total) if total > 0 else 0.0,
        "boundary_fraction": float(boundary.mean()) if boundary.size else 0.0,
    }


def update_load(
    key_change: np.ndarray, value_change: np.ndarray, key_rel: np.ndarray, value_rel: np.ndarray
) -> dict[str, float]:
    """Concentration of the update magnitudes ``‖Δk_i‖``, ``‖Δv_i‖`` over the retained entries."""
    return {
        "updated": float(((key_rel > CHANGED_TOL) | (value_rel > CHANGED_TOL)).mean()) if key_rel.size else 0.0,
        "dk_rel_mean": float(key_rel.mean()) if key_rel.size else 0.0,
        "dv_rel_mean": float(value_rel.mean()) if value_rel.size else 0.0,
        "dk_top10_share": top_share(key_change, 0.1),
        "dv_top10_share": top_share(value_change, 0.1),
        "dk_gini": gini(key_change),
        "dv_gini": gini(value_change),
    }
