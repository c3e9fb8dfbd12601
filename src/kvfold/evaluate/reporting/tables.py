"""Markdown tables and the labels every report shares: budgets, numbers, intervals, record layouts.

:func:`markdown_table` is the one table builder of kvfold's reports (eval, fidelity, merge maps,
benchmarks): a header row, an alignment row and one row per entry, with cells given as text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvfold.evaluate.scoring.records import SUMMARY_TASKS, names_full

__all__ = [
    "ALIGNMENTS",
    "FULL_BUDGET",
    "budget_label",
    "budget_sort_key",
    "format_interval",
    "format_number",
    "header_lines",
    "markdown_table",
    "ordered",
    "split_records",
    "table_budgets",
]

FULL_BUDGET = 1.0
"""The budget ``full`` runs at: the uncompressed cache."""

ALIGNMENTS = {"left": ":---", "right": "---:", "none": "---"}
"""The alignment row's cell for each column alignment of :func:`markdown_table`."""


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], align: str | Sequence[str] = ("left", "right")
) -> str:
    """A Markdown table: the header, the alignment row, then one line per row (no final newline).

    Args:
        header: the column names.
        rows: the cells of each row, as text (``len(header)`` each).
        align: ``"left"``, ``"right"`` or ``"none"`` for every column, or one per column; a shorter
            sequence repeats its last entry. The default puts a name column left and numbers right.

    Example:
        >>> print(markdown_table(["method", "score"], [["`full`", "70.0"]]))
        | method | score |
        |:---|---:|
        | `full` | 70.0 |
    """
    kinds = [align] if isinstance(align, str) else list(align)
    kinds += [kinds[-1]] * (len(header) - len(kinds))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(ALIGNMENTS[k] for k in kinds[: len(header)]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def budget_sort_key(budget: Any) -> tuple[int, float]:
    """Fractions first (ascending), then token counts (ascending)."""
    return (0, float(budget)) if isinstance(budget, float) else (1, float(budget))


def budget_label(budget: Any) -> str:
    """``0.2`` for a fraction, ``256 tok`` for a token count."""
    return f"{budget:g}" if isinstance(budget, float) else f"{budget} tok"


def format_number(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals; ``–`` when it is missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def format_interval(value: float | None, interval: Sequence[float] | None, scale: float, digits: int) -> str:
    """``value × scale`` with its 95% interval in brackets when both ends are known; ``–`` when missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = f"{value * scale:.{digits}f}"
    if interval and not any(v is None or math.isnan(v) for v in interval):
        text += f" [{interval[0] * scale:.{digits}f}, {interval[1] * scale:.{digits}f}]"
    return text


def ordered(values: Iterable[Any]) -> list[Any]:
    """The distinct values, in the order first seen."""
    return list(dict.fromkeys(values))


def split_records(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[Any], list[str]]:
    """Methods (as first seen), compressed budgets (sorted) and tasks (as first seen, averages left out)."""
    methods = ordered([r["method"] for r in records])
    budgets = sorted({r["budget"] for r in records if not names_full(r["method"])}, key=budget_sort_key)
    tasks = [t for t in ordered([r["task"] for r in records]) if t not in SUMMARY_TASKS]
    return methods, budgets, tasks


def table_budgets(budgets: Iterable[Any]) -> list[Any]:
    """Budgets as table columns: from the mildest compression to the strongest."""
    return sorted(budgets, key=budget_sort_key, reverse=True) or [FULL_BUDGET]


def header_lines(title: str, info: Mapping[str, Any] | None) -> list[str]:
    """``# title`` and, when given, the run facts (``**model**: …, **dataset**: …``) under it."""
    lines = [f"# {title}", ""]
    if info:
        lines += [", ".join(f"**{k}**: {v}" for k, v in info.items() if v is not None), ""]
    return lines
