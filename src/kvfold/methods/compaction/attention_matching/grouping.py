"""How Attention Matching's problems are grouped to be fitted together (:func:`.solve.fit_problems`).

A group pads every problem to its widest one, so the CPU keeps widths within :data:`WIDTH_SLACK`
of the widest (the work is the time); where each group costs its kernel launches (a GPU), a group
also takes narrower problems while their padding's multiply-adds (:func:`padding_products`) stay
within a budget (``FitConfig.pad_products``). A group's memory is its attention statistics' one block
of features (:func:`statistics_block_bytes`) and its problems' own bytes (:func:`bytes_per_problem`);
the fits' multiply-adds are counted in :data:`FIT_PRODUCTS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

GROUP_LAUNCH_PRODUCTS = 1 << 35
"""About the multiply-adds a GPU does in float32 while the host launches one group of problems: a
group dispatches about 360 operators (``benchmarks/profile_compress.py --count``) at about 5 µs each,
1.8 ms, in which an H200 (about 67 TFLOP/s in float32, half of it reached) does about 3·10¹⁰
multiply-adds. An estimate, not a measurement: a GPU run tells (``benchmarks/gpu.sh``)."""

WIDTH_SLACK = 0.8
"""A group's narrowest problem keeps at least this fraction of its widest one's entries."""


@dataclass
class ProductCount:
    """Multiply-adds of the fits' products, counted as the groups run: a cost measure that does not
    depend on the machine (a fit whose cost grows linearly with the context keeps it linear).

    Per group of ``P`` problems padded to ``n`` queries, ``T`` entries of key width ``d`` and value
    width ``D``, keeping ``t``: the statistics ``P·n·T·(d + D)`` (logits, ``Φ V``), the normal
    equations of β and the values ``P·n·t·(2t + 2d + 2D)`` (``Φ_S`` twice, ``Φ_Sᵀ Φ_S``, ``XᵀX``,
    ``X V_S``, ``Xᵀ R``), and for OMP its correlations ``P·n·T·t``.
    """

    products: int = 0

    def add(self, problems: int, n: int, T: int, t: int, d: int, D: int, omp: bool) -> None:
        self.products += problems * n * (T * (d + D) + t * (2 * t + 2 * d + 2 * D) + (T * t if omp else 0))


FIT_PRODUCTS = ProductCount()
"""The running count of :class:`ProductCount` (read it before and after a fit)."""


def groups_by_width(
    todo: Tensor,
    counts: Tensor,
    per_problem: Callable[[int], int],
    group_bytes: int,
    padding: Callable[[int, int], int] | None = None,
    pad_products: int = 0,
) -> list[tuple[Tensor, int]]:
    """Split the problems ``todo`` into groups fitted together: widest first, each group within
    ``group_bytes`` (``per_problem(t)`` bytes a problem of width ``t``) and no narrower than
    :data:`WIDTH_SLACK` of its widest problem. A group pads every problem to its widest one and
    the fit costs ``n·t²`` per problem, so under a global budget (one head of a layer keeping
    1,700 entries, another 11) mixing widths would multiply the work.

    Where each group costs its launches (a GPU), a group also takes narrower problems while the
    multiply-adds their padding adds (``padding(widest, width)`` each) stay within
    ``pad_products`` in all: the work grows by at most a group's launches' worth, the operators
    fall by a group's.

    Returns:
        ``(rows, widest)`` a group: its problems and its widest problem's width (known on the host,
        so the fit asks the device for none).
    """
    if todo.numel() == 0:
        return []
    order = counts[todo].argsort(descending=True, stable=True)
    todo, widths = todo[order], counts[todo][order].tolist()
    groups, start = [], 0
    while start < len(widths):
        widest = widths[start]
        cap = max(1, int(group_bytes // max(1, per_problem(widest))))
        stop, padded = start + 1, 0
        while stop < len(widths) and stop - start < cap:
            if widths[stop] < WIDTH_SLACK * widest:
                extra = padding(widest, widths[stop]) if padding is not None else pad_products + 1
                if padded + extra > pad_products:
                    break
                padded += extra
            stop += 1
        groups.append((todo[start:stop], widest))
        start = stop
    return groups


def padding_products(scored: bool, T: int, n: int, d: int, D: int) -> Callable[[int, int], int]:
    """Multiply-adds a problem of width ``t`` adds when padded to ``widest``: the terms of a fit's
    multiply-adds that grow with the width (:class:`ProductCount`;
    ``scored``: highest attention or given keys, else OMP, whose correlations read every entry)."""

    def padding(widest: int, t: int) -> int:
        grown = n * (2 * (widest * widest - t * t) + 2 * (d + D) * (widest - t))
        return grown if scored else grown + n * T * (widest - t)

    return padding


def bytes_per_problem(scored: bool, T: int, n: int, D: int, size: int, rows_held: int) -> Callable[[int], int]:
    """Bytes one problem of width ``t`` holds while its group is fitted, beyond the attention statistics' block
    (:func:`statistics_block_bytes`, once a group): ``T`` entries, ``n`` queries of width ``D``, ``size`` bytes
    an element; ``scored`` (highest attention or given keys) holds ``rows_held`` queries of the normal
    equations at a time, OMP its features ``Φ`` (``n × T``) and ``Φᵀ Φ_S`` (``T × t``)."""

    def per_problem(t: int) -> int:
        if scored:  # its inputs and statistics (n × D), then blocks of rows × t
            return size * (rows_held * 3 * t + n * (2 * D + 4) + 2 * t * (t + D) + T * D * 2)
        return size * (n * T + T * t + n * D)

    return per_problem


def statistics_block_bytes(T: int, n: int, size: int, rows: int, budget: int) -> int:
    """Bytes of the features a group of scored problems holds at most while its attention statistics are
    computed (:func:`~kvfold.methods.compaction.attention_matching.features.block_statistics`): one block of
    ``rows`` queries (at most ``n``) over ``T`` entries, for as many problems as ``budget`` bytes hold (at least
    one), whatever the group's size."""
    problems = max(1, budget // max(1, rows * T * size))
    return problems * min(n, rows) * T * size
