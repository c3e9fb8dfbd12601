"""How many entries each layer and each KV head keeps (the "budget allocation" decision).

All allocations are integers that sum **exactly** to the requested total and respect the given
minimum / maximum per part. Real-valued schedules are rounded with the largest-remainder method
(ties to the lower index), which keeps every part within ``[⌊x⌋, ⌈x⌉]`` of its real value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from kvfold.methods.core.selection import as_counts, priority_order, topk_keep

Tensor = torch.Tensor

__all__ = [
    "apportion",
    "check_layer_budgets",
    "cosine_layer_budgets",
    "global_head_budgets",
    "uniform_layer_budgets",
]


def apportion(
    weights: Sequence[float] | Tensor,
    total: int,
    minimum: int = 0,
    maximum: int | None = None,
) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` within ``[minimum, maximum]``.

    The real allocation is ``clamp(s · w_i, minimum, maximum)`` with the scale ``s`` chosen so it
    sums to ``total`` (water filling, found by bisection); it is then rounded by largest
    remainder (ties to the lower index). All-zero weights split evenly.

    Raises:
        ValueError: negative weights, or ``total`` outside ``[L·minimum, L·maximum]``.
    """
    w = [float(x) for x in (weights.tolist() if isinstance(weights, Tensor) else weights)]
    parts = len(w)
    if parts == 0:
        raise ValueError("need at least one part")
    if any(x < 0 or math.isnan(x) for x in w):
        raise ValueError(f"weights must be ≥ 0; got {w}")
    hi = math.inf if maximum is None else maximum
    if minimum > hi or not (parts * minimum <= total <= parts * hi):
        raise ValueError(f"cannot split {total} into {parts} parts each in [{minimum}, {maximum}]")
    if sum(w) == 0:
        w = [1.0] * parts

    def filled(scale: float) -> list[float]:
        return [min(max(scale * x, minimum), hi) for x in w]

    low, high = 0.0, 1.0
    while sum(filled(high)) < total:
        high *= 2.0
        if high > 1e300:
            raise ValueError(f"cannot reach {total} with weights {w}: zero-weight parts stay at the minimum")
    for _ in range(200):  # bisection on the scale
        mid = 0.5 * (low + high)
        if sum(filled(mid)) < total:
            low = mid
        else:
            high = mid
    real = filled(high)
    counts = [min(max(math.floor(x + 1e-9), minimum), hi) for x in real]
    counts = [int(c) for c in counts]
    remainder = [x - c for x, c in zip(real, counts, strict=True)]
    missing = total - sum(counts)
    while missing != 0:  # at most a few passes; each moves one unit
        step = 1 if missing > 0 else -1
        candidates = [i for i in range(parts) if (counts[i] < hi if step > 0 else counts[i] > minimum)]
        best = max(candidates, key=lambda i: (step * remainder[i], -i))
        counts[best] += step
        remainder[best] -= step
        missing -= step
    return counts


def uniform_layer_budgets(total_per_layer: int, num_layers: int) -> list[int]:
    """The same budget in every layer (SnapKV, H2O, …)."""
    if total_per_layer < 0 or num_layers < 1:
        raise ValueError(f"need total_per_layer ≥ 0 and num_layers ≥ 1; got {total_per_layer}, {num_layers}")
    return [int(total_per_layer)] * num_layers


def cosine_layer_budgets(
    avg_budget: int,
    num_layers: int,
    min_ratio: float = 0.2,
    context_tokens: int | None = None,
    min_budget: int = 1,
) -> list[int]:
    """Cosine layer decay, the PyramidInfer-style schedule KeepKV uses (KeepKV Appendix B; Yang et
    al. 2024, "PyramidInfer"): budgets shrink with depth along half a cosine.

    Formula (ours; the papers give no closed form): weight of layer ``l`` of ``L``
    ``w_l = r + (1 − r) · (1 + cos(π · l / (L − 1))) / 2``, from 1 at layer 0 to ``r = min_ratio``
    at the last layer; budgets ``∝ w_l`` scaled to mean ``avg_budget`` (so layer 0 gets
    ``≈ 2·avg/(1 + r)``), clamped to ``[min_budget, N]`` by water filling and rounded by largest
    remainder: the total is exactly ``L · min(avg_budget, N)``.

    Args:
        avg_budget: mean entries per layer (per KV head).
        num_layers: ``L``.
        min_ratio: ``r`` in ``(0, 1]``, last-layer / first-layer budget before clamping.
        context_tokens: ``N`` or None.
        min_budget: least entries per layer (e.g. sinks + recent window).
    """
    check_layer_budgets(avg_budget, num_layers, min_budget)
    if not 0.0 < min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in (0, 1]; got {min_ratio}")
    if context_tokens is not None and avg_budget >= context_tokens:
        return [int(context_tokens)] * num_layers
    if num_layers == 1:
        return [int(avg_budget)]
    weights = [
        min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * layer / (num_layers - 1)))
        for layer in range(num_layers)
    ]
    return apportion(weights, avg_budget * num_layers, minimum=min(min_budget, avg_budget), maximum=context_tokens)


def check_layer_budgets(avg_budget: int, num_layers: int, min_budget: int) -> None:
    """Check the arguments every layer schedule takes (cosine here, PyramidKV's in
    :func:`kvfold.methods.eviction.snapkv.pyramid_layer_budgets`).

    Raises:
        ValueError: ``avg_budget`` is not a positive int (a token count, see
            :meth:`kvfold.runtime.budget.Budget.count`), or ``num_layers`` or ``min_budget`` < 1.
    """
    if isinstance(avg_budget, bool) or not isinstance(avg_budget, numbers.Integral) or avg_budget < 1:
        raise ValueError(f"avg_budget must be a positive token count (use Budget.count); got {avg_budget!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be ≥ 1; got {num_layers}")
    if min_budget < 1:
        raise ValueError(f"min_budget must be ≥ 1; got {min_budget}")


def global_head_budgets(
    scores: Sequence[Tensor],
    totals: int | Tensor,
    protected: Sequence[Tensor | None] | None = None,
    valid: Sequence[Tensor | None] | None = None,
    minimum: int = 0,
) -> list[Tensor]:
    """Per-(layer, head) budgets from **one ranking of every entry of every layer and head**
    (KVzip's non-uniform allocation, Kim et al. 2025, arXiv:2505.23416, §3.2).

    For each batch row, the ``totals[b]`` kept entries are: the protected ones, then each
    ``(layer, head)``'s ``minimum`` best (a floor, so that no head is left empty), then the
    highest scores of all layers and heads together. Ties go to the lower layer, head, position.
    Scores must be comparable across the parts they are ranked with (normalise first where they
    are not, e.g. :func:`kvfold.methods.core.scoring.zscore` per layer).

    Args:
        scores: one ``(B, H_l, N_l)`` tensor per layer (layers may differ in heads and length).
        totals: entries kept per batch row over all the given layers: an int or ``(B,)``.
        protected: per layer ``(B, H_l, N_l)`` bool or None (kept first).
        valid: per layer ``(B, H_l, N_l)`` bool or None (padding is never kept).
        minimum: least entries per (layer, head) (protected ones count), capped by its valid entries.

    Returns:
        One ``(B, H_l)`` long tensor per layer; per batch row they sum to exactly
        ``min(totals[b], valid entries)`` (more only when the floors alone exceed it).

    Example:
        >>> a = torch.tensor([[[0.9, 0.8, 0.7], [0.1, 0.1, 0.1]]])  # layer 0: head 0 scores high
        >>> b = torch.tensor([[[0.2, 0.6, 0.0]]])                     # layer 1: one head
        >>> [c.tolist() for c in global_head_budgets([a, b], 4)]
        [[[3, 0]], [[1]]]
    """
    if not scores:
        raise ValueError("need the scores of at least one layer")
    if minimum < 0:
        raise ValueError(f"minimum must be ≥ 0; got {minimum}")
    batch, device = scores[0].shape[0], scores[0].device
    shapes = [tuple(s.shape) for s in scores]
    flat_scores, flat_prot, flat_valid = [], [], []
    for j, s in enumerate(scores):
        ok = torch.ones_like(s, dtype=torch.bool) if valid is None or valid[j] is None else valid[j].bool()
        prot = torch.zeros_like(ok) if protected is None or protected[j] is None else protected[j].bool() & ok
        if minimum:  # the floor: each head's first `minimum` entries in keep-first order count as protected
            order = priority_order(s, prot, ok)[..., :minimum]
            floor = torch.zeros_like(ok).scatter_(-1, order, True) & ok
            prot = prot | floor
        flat_scores.append(s.reshape(batch, -1).to(torch.float64))
        flat_prot.append(prot.reshape(batch, -1))
        flat_valid.append(ok.reshape(batch, -1))
    flat = torch.cat(flat_scores, dim=-1)[:, None]  # (B, 1, Σ H_l·N_l)
    prot = torch.cat(flat_prot, dim=-1)[:, None]
    ok = torch.cat(flat_valid, dim=-1)[:, None]
    totals_t = as_counts(totals, batch, 1, device)
    totals_t = torch.maximum(totals_t, prot.sum(-1))  # protected entries (and floors) are always kept
    keep, lengths = topk_keep(flat, totals_t, protected=prot, valid=ok)
    in_row = torch.arange(keep.shape[-1], device=device)[None, :] < lengths  # (B, K)
    hits = torch.zeros(batch, flat.shape[-1], dtype=torch.long, device=device)
    hits.scatter_add_(1, keep[:, 0], in_row.long())
    out, offset = [], 0
    for b_, heads, length in shapes:
        part = hits[:, offset : offset + heads * length].view(b_, heads, length)
        out.append(part.sum(-1))
        offset += heads * length
    return out
