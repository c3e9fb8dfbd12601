"""PNG plots of evaluation results: score and retention against budget or compression time.

Each plot takes ``results.json`` records (:func:`kvfold.evaluate.scoring.records.aggregate`); the
fidelity plot is :func:`kvfold.evaluate.reporting.fidelity_report.plot_fidelity`. matplotlib draws
on its file-only Agg backend (:func:`pyplot`), so plots are written without a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvfold.evaluate.reporting.tables import FULL_BUDGET, budget_label, budget_sort_key, ordered, split_records
from kvfold.evaluate.scoring.records import AVERAGE_TASK, HEADLINE_TASK, names_full
from kvfold.runtime.files import atomic_path

__all__ = [
    "axis_positions",
    "budget_axis_label",
    "plot_retention",
    "plot_scores",
    "pyplot",
    "save_figure",
    "style_budget_axis",
    "title_suffix",
]

RETENTION_MARKERS = "os^Dv<>p*hX"
"""Marker shapes of the budgets in the retention-against-time plot."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, *, tight_box: bool = False) -> Path:
    """Write ``fig`` as a PNG at 120 dpi (cropped to its content with ``tight_box``), atomically, and close it.

    Raises:
        OutputError: the file cannot be written (the old one, if any, is left whole).
    """
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            if tight_box:
                fig.savefig(tmp, dpi=120, bbox_inches="tight")
            else:
                fig.savefig(tmp, dpi=120)
    finally:
        pyplot().close(fig)
    return path


def title_suffix(info: Mapping[str, Any] | None) -> str:
    """`` — dataset @ length, model`` from the run facts that are known."""
    if not info:
        return ""
    dataset = str(info.get("dataset") or "")
    if dataset and info.get("length"):
        dataset += f" @ {info['length']} tokens"
    parts = [p for p in (Path(dataset).name if dataset.endswith(".jsonl") else dataset, info.get("model")) if p]
    return " — " + ", ".join(map(str, parts)) if parts else ""


def axis_positions(budgets: Sequence[Any]) -> tuple[dict[Any, float], bool]:
    """x positions per budget: the fractions themselves, their log₂ when they span 8× or more (a
    compression-ratio axis: keep 1/2 … 1/32 evenly spaced), or evenly spaced when token counts
    appear."""
    numeric = all(isinstance(b, float) for b in budgets)
    if not numeric:
        return {b: float(i) for i, b in enumerate(budgets)}, numeric
    if _ratio_axis(budgets):
        return {b: math.log2(b) for b in budgets}, numeric
    return {b: float(b) for b in budgets}, numeric


def _ratio_axis(budgets: Sequence[Any]) -> bool:
    """Fractions spanning 8× or more are placed by their log₂."""
    return len(budgets) > 1 and min(budgets) > 0 and max(budgets) / min(budgets) >= 8


def budget_axis_label(numeric: bool) -> str:
    """The budget axis's label: fractions, or budgets of any kind."""
    return "cache budget (fraction of the context kept)" if numeric else "cache budget"


def style_budget_axis(ax: Any, budgets: Sequence[Any], numeric: bool) -> None:
    """Ticks, label, limits and grid of a budget x axis."""
    positions, _ = axis_positions(budgets)
    ax.set_xticks([positions[b] for b in budgets], [budget_label(b) for b in budgets])
    ax.set_xlabel(budget_axis_label(numeric))
    if numeric and _ratio_axis(budgets):
        ax.set_xticks([positions[b] for b in budgets], [f"{budget_label(b)}\n({1 / b:g}×)" for b in budgets])
        ax.set_xlim(math.log2(min(budgets)) - 0.4, math.log2(max(budgets)) + 0.4)
    elif numeric:
        span = max(budgets) - min(budgets) if len(budgets) > 1 else 0.1
        ax.set_xlim(min(budgets) - 0.08 * span - 0.02, max(budgets) + 0.08 * span + 0.02)
    else:
        ax.set_xlim(-0.5, len(budgets) - 0.5)
    ax.grid(True, alpha=0.3)


def _draw_scores(
    ax: Any, records: Sequence[Mapping[str, Any]], task: str, budgets: Sequence[Any], colors: Mapping[str, Any]
) -> None:
    positions, _ = axis_positions(budgets)
    for method, color in colors.items():
        points = sorted(
            ((r["budget"], r["score"]) for r in records if r["method"] == method and r["task"] == task),
            key=lambda p: budget_sort_key(p[0]),
        )
        if not points:
            continue
        if names_full(method):
            ax.axhline(points[0][1], color=color, linestyle="--", linewidth=1.5, label=f"{method} (no compression)")
        else:
            xs = [positions[b] for b, _ in points if b in positions]
            ax.plot(xs, [s for b, s in points if b in positions], marker="o", color=color, label=method)


def plot_scores(
    records: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    by_task: bool = False,
    title: str = "Score vs cache budget",
) -> Path:
    """Score against budget per method (``full`` dashed); one panel, or one per task with ``by_task``.

    Returns:
        The PNG path.
    """
    plt = pyplot()
    methods, budgets, tasks = split_records(records)
    budgets = budgets or [FULL_BUDGET]
    cmap = plt.get_cmap("tab10")
    colors = {m: cmap(i % 10) for i, m in enumerate(methods)}
    panels = tasks if by_task else [AVERAGE_TASK]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols if by_task else 7.5, 3.3 * rows if by_task else 5), squeeze=False, sharey=True
    )
    _, numeric = axis_positions(budgets)
    for i, (ax, task) in enumerate(zip(axes.flat, panels, strict=False)):
        _draw_scores(ax, records, task, budgets, colors)
        style_budget_axis(ax, budgets, numeric)
        ax.set_ylim(-3, 103)
        ax.set_title("average over tasks" if task == AVERAGE_TASK else task, fontsize=11)
        if i % cols == 0:
            ax.set_ylabel("score (0–100)")
        if by_task:
            ax.set_xlabel("")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if by_task:
        height = fig.get_figheight()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), frameon=False)
        fig.supxlabel(axes.flat[0].xaxis.get_label_text() or budget_axis_label(numeric), y=0.35 / height)
        fig.suptitle(title, fontsize=13)
        fig.tight_layout(rect=(0, 0.65 / height, 1, 1 - 0.1 / height))
    else:
        axes.flat[0].legend(loc="best", fontsize=9)
        fig.suptitle(title, fontsize=13)
        fig.tight_layout()
    return save_figure(fig, path)


def _pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (less time, more retention), by time."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _retention_errors(mine: Sequence[Mapping[str, Any]], ys: Sequence[float]) -> list[list[float]]:
    """Lower and upper error-bar lengths (percent) of each record's retention interval; 0 where unknown."""
    errors = [
        [
            max(0.0, y - 100 * (r.get("retention_ci") or [math.nan])[0]) if r.get("retention_ci") else 0.0
            for y, r in zip(ys, mine, strict=True)
        ],
        [
            max(0.0, 100 * (r.get("retention_ci") or [0, math.nan])[1] - y) if r.get("retention_ci") else 0.0
            for y, r in zip(ys, mine, strict=True)
        ],
    ]
    return [[0.0 if math.isnan(e) else e for e in side] for side in errors]


def _draw_against_time(
    ax: Any,
    method: str,
    mine: Sequence[Mapping[str, Any]],
    ys: Sequence[float],
    errors: Sequence[Sequence[float]],
    color: Any,
    budgets: Sequence[Any],
) -> None:
    """One point per budget of one method at its compression-over-prefill time, marker by budget."""
    for r, y, lo, hi in zip(mine, ys, *errors, strict=True):
        ax.errorbar(
            r.get("compress_over_prefill", math.nan),
            y,
            yerr=[[lo], [hi]],
            color=color,
            marker=RETENTION_MARKERS[budgets.index(r["budget"]) % len(RETENTION_MARKERS)],
            capsize=2,
            linestyle="none",
            label=method if r is mine[0] else None,
        )


def _time_axis(ax: Any, rows: Sequence[Mapping[str, Any]], budgets: Sequence[Any]) -> None:
    """The Pareto front of (time, retention), a symlog time axis, and the marker legend in its label."""
    front = _pareto(
        [
            (r["compress_over_prefill"], 100 * r["retention"])
            for r in rows
            if not math.isnan(r.get("compress_over_prefill", math.nan))
        ]
    )
    if front:
        ax.step(
            [x for x, _ in front],
            [y for _, y in front],
            where="post",
            color="grey",
            alpha=0.6,
            label="Pareto front",
        )
    ax.set_xscale("symlog", linthresh=0.1)
    markers = RETENTION_MARKERS
    ax.set_xlabel(
        "compression time / prefill time of the same context (marker shape = budget: "
        + ", ".join(f"{markers[i % len(markers)]} {budget_label(b)}" for i, b in enumerate(budgets))
        + ")"
    )


def plot_retention(
    records: Sequence[Mapping[str, Any]], path: str | Path, *, against: str = "budget", title: str = ""
) -> Path | None:
    """Headline retention (%) with 95% intervals against budget, or against compression time.

    Args:
        records: ``results.json`` records (needs ``headline`` rows with ``retention``).
        path: the PNG to write.
        against: ``"budget"`` (one line per method) or ``"time"`` (compression seconds over the
            prefill seconds of the same context; one point per method × budget, the Pareto front
            drawn): the picture for choosing a method.
        title: the figure title.

    Returns:
        The PNG path, or None when no record has a retention to plot.
    """
    plt = pyplot()
    rows = [
        r
        for r in records
        if r["task"] == HEADLINE_TASK and r.get("retention") is not None and not names_full(r["method"])
    ]
    if not rows:
        return None
    methods = ordered([r["method"] for r in rows])
    budgets = sorted({r["budget"] for r in rows}, key=budget_sort_key)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    positions, numeric = axis_positions(budgets)
    for i, method in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: budget_sort_key(r["budget"]))
        ys = [100 * r["retention"] for r in mine]
        errors = _retention_errors(mine, ys)
        if against == "time":
            _draw_against_time(ax, method, mine, ys, errors, cmap(i % 20), budgets)
        else:
            ax.errorbar(
                [positions[r["budget"]] for r in mine],
                ys,
                yerr=errors,
                color=cmap(i % 20),
                marker="o",
                capsize=2,
                label=method,
            )
    ax.axhline(100, color="black", linestyle="--", linewidth=1, label="full cache")
    if against == "time":
        _time_axis(ax, rows, budgets)
    else:
        style_budget_axis(ax, budgets, numeric)
    ax.set_ylabel("headline retention (% of the full cache's score)")
    ax.set_ylim(-3, 110)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.suptitle(
        title or ("Retention vs compression time" if against == "time" else "Retention vs cache budget"), fontsize=12
    )
    fig.tight_layout()
    return save_figure(fig, path)
