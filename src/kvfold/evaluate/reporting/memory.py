"""Retention against memory in bytes: the table and plot that compare token-only, quantized and
combined pipelines at equal bytes.

Every record carries ``memory_ratio``: the cache's bytes over the full cache's in 16 bits, with
unquantized elements counted at 16 bits whatever dtype the run computed in (records written
before the field existed fall back to their ``kv_ratio``, which is the same for an unquantized
cache). So a row of ``kvzip`` at keep 0.1, one of ``full@int4`` and one of ``kvzip+am_fit@int4``
under ``--memory 0.03125`` sit on one axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfold.evaluate.reporting.plots import pyplot, save_figure
from kvfold.evaluate.reporting.tables import budget_label, format_interval, format_number, markdown_table, ordered
from kvfold.evaluate.scoring.records import AVERAGE_TASK, HEADLINE_TASK, names_full

__all__ = ["has_memory_axis", "memory_markdown", "plot_retention_memory"]


def _rows(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [
        r
        for r in records
        if r["task"] == HEADLINE_TASK and r.get("retention") is not None and not names_full(r["method"])
    ]


def _ratio(record: Mapping[str, Any]) -> float:
    return float(record.get("memory_ratio", record.get("kv_ratio", math.nan)))


def has_memory_axis(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the runs hold a memory budget or a quantized cache (the memory table then says more
    than the budget tables)."""
    return any(r.get("memory") is not None or r.get("kv_format", "16") != "16" for r in records)


def memory_markdown(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """``## Retention against memory``: one row per method and budget, by decreasing bytes (the
    average score beside the headline retention, which needs a task the full cache solves)."""
    rows = sorted(
        (r for r in records if r["task"] == AVERAGE_TASK and not names_full(r["method"])),
        key=lambda r: (-_ratio(r), r["method"]),
    )
    if not rows:
        return []
    headline = {(r["method"], r["budget"]): r for r in records if r["task"] == HEADLINE_TASK}
    table = [
        [
            f"`{r['method']}`",
            "—" if r.get("memory") is None else budget_label(r["memory"]),
            budget_label(r["budget"]) if r.get("memory") is None else "(memory)",
            r.get("kv_format", "16"),
            format_number(_ratio(r), 4),
            f"1/{1 / _ratio(r):.1f}" if _ratio(r) > 0 else "—",
            format_interval(
                headline.get((r["method"], r["budget"]), {}).get("retention"),
                headline.get((r["method"], r["budget"]), {}).get("retention_ci"),
                100,
                1,
            ),
            format_number(r.get("score"), 1),
        ]
        for r in rows
    ]
    header = [
        "method", "memory asked", "budget", "format", "memory / 16-bit full", "fraction", "retention %", "score",
    ]  # fmt: skip
    return [
        "## Retention against memory (bytes at 16 bits)",
        "",
        "The cache's bytes (codes, scales, zero points, β, unquantized entries at 16 bits) over the full "
        "cache's in 16 bits, before any question is appended; retention as above (95% intervals).",
        "",
        markdown_table(header, table),
        "",
    ]


def plot_retention_memory(records: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path | None:
    """Headline retention (%) against the memory fraction of the 16-bit full cache (log axis), one line
    per method (a quantization-only pipeline is one point).

    Returns:
        The PNG path, or None when no record has a retention.
    """
    rows = _rows(records)
    if not rows:
        return None
    plt = pyplot()
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for i, method in enumerate(ordered([r["method"] for r in rows])):
        mine = sorted((r for r in rows if r["method"] == method), key=_ratio)
        xs = [_ratio(r) for r in mine]
        ys = [100 * r["retention"] for r in mine]
        low = [max(0.0, y - 100 * (r.get("retention_ci") or [y / 100])[0]) for y, r in zip(ys, mine, strict=True)]
        high = [max(0.0, 100 * (r.get("retention_ci") or [0, y / 100])[1] - y) for y, r in zip(ys, mine, strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], color=cmap(i % 10), marker="o", capsize=2, label=method)
    ax.axhline(100, color="black", linestyle="--", linewidth=1, label="full cache (16 bits)")
    ax.set_xscale("log", base=2)
    ticks = [2.0**-k for k in range(1, 7)]
    ax.set_xticks(ticks, [f"1/{2**k}" for k in range(1, 7)])
    ax.set_xlim(1 / 80, 0.7)
    ax.invert_xaxis()
    ax.set_xlabel("memory: the cache's bytes / the full cache's bytes in 16 bits (log scale)")
    ax.set_ylabel("headline retention (% of the full cache's score)")
    ax.set_ylim(-3, 110)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.suptitle(title or "Retention vs memory", fontsize=12)
    fig.tight_layout()
    return save_figure(fig, path)
