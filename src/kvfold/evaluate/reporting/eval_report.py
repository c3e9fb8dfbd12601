"""The eval report (``report.md`` and its plots) from ``results.json`` records.

A summary of retention (methods ranked at each budget, with 95% intervals), the average score
(method × budget), the KV-cache size ratio (method × budget), and one table per budget with a row
per method and a column per task plus the average. Plots (:mod:`kvfold.evaluate.reporting.plots`)
show retention and score against budget per method, ``full`` as a dashed horizontal line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfold.evaluate.reporting.memory import has_memory_axis, memory_markdown, plot_retention_memory
from kvfold.evaluate.reporting.plots import plot_retention, plot_scores, title_suffix
from kvfold.evaluate.reporting.tables import (
    FULL_BUDGET,
    budget_label,
    format_interval,
    format_number,
    header_lines,
    markdown_table,
    split_records,
    table_budgets,
)
from kvfold.evaluate.scoring.records import AVERAGE_TASK, HEADLINE_TASK, SUMMARY_TASKS, names_full
from kvfold.runtime.files import atomic_write_text

__all__ = ["eval_markdown", "write_eval_report"]


def _retention_section(
    records: Sequence[Mapping[str, Any]], methods: Sequence[str], budgets: Sequence[Any], full: Sequence[str]
) -> list[str]:
    """Methods ranked by headline retention at each budget, with 95% intervals, then the task split."""
    headline = [r for r in records if r["task"] == HEADLINE_TASK and r.get("retention") is not None]
    if not full:
        return ["No `full` run: retention (score / full-cache score) needs one.", ""]
    if not headline:
        return ["The full cache scores below 50 on every task: no headline (retention is not informative).", ""]
    tasks = headline[0].get("tasks", [])
    apart = sorted({r["task"] for r in records if r.get("headline") is False})
    lines = [
        "## Retention (headline)",
        "",
        "Retention = score / the full cache's score on the same samples, macro-averaged over the tasks the "
        f"full cache solves (≥ 50): {', '.join(tasks)}. Brackets: 95% intervals (paired bootstrap over "
        "contexts; none where a task has a single context, whose redraws cannot show spread). Two methods differ "
        "only where their intervals do not overlap.",
        "",
    ]
    if apart:
        lines += [f"Reported apart (full cache below 50): {', '.join(apart)}.", ""]
    index = {(r["method"], r["budget"], r["task"]): r for r in records}
    for budget in budgets:
        ranked = sorted(
            (r for r in headline if r["budget"] == budget and r["method"] not in full),
            key=lambda r: -r["retention"],
        )
        if not ranked:
            continue
        rows = []
        for rank, r in enumerate(ranked, start=1):
            noise = index.get((r["method"], budget, f"{HEADLINE_TASK}_noise"), {})
            prose = index.get((r["method"], budget, f"{HEADLINE_TASK}_prose"), {})
            rows.append(
                [
                    str(rank),
                    f"`{r['method']}`",
                    format_interval(r["retention"], r.get("retention_ci"), 100, 1),
                    format_interval(r["score"], r.get("score_ci"), 1, 1),
                    format_interval(noise.get("retention"), noise.get("retention_ci"), 100, 1),
                    format_interval(prose.get("retention"), prose.get("retention_ci"), 100, 1),
                    format_number(r.get("compress_over_prefill"), 2),
                ]
            )
        header = ["#", "method", "retention %", "score", "noise ret. %", "prose ret. %", "compress / prefill"]
        lines += [f"### Budget {budget_label(budget)}", "", markdown_table(header, rows), ""]
    reference = index.get((full[0], FULL_BUDGET, HEADLINE_TASK))
    if reference:
        lines += [f"`full` headline score: {format_interval(reference['score'], reference.get('score_ci'), 1, 1)}.", ""]
    return lines


def eval_markdown(records: Sequence[Mapping[str, Any]], info: Mapping[str, Any] | None = None) -> str:
    """The eval report: summary (method × budget), KV ratio, then task tables per budget.

    Args:
        records: ``results.json`` records (with ``"average"`` task rows).
        info: run facts shown under the title (model, dataset, ...).
    """
    methods, budgets, tasks = split_records(records)
    budgets = table_budgets(budgets) if budgets else []
    mode = {bool(r.get("query_aware")) for r in records}
    index = {(r["method"], r["budget"], r["task"]): r for r in records}
    full = [m for m in methods if names_full(m)]
    compressed = [m for m in methods if m not in full]
    lines = header_lines("kvfold eval", info)
    lines += [
        f"Protocol: {'query-aware' if mode == {True} else 'query-agnostic'}. Scores are 0–100 "
        "(mean over samples; the average is the macro average over tasks). "
        f"`full` is the uncompressed cache (budget {FULL_BUDGET:.1f}).",
        "",
    ]

    def cell(method: str, budget: Any, task: str, key: str = "score", digits: int = 1) -> str:
        record = index.get((method, FULL_BUDGET if method in full else budget, task))
        return format_number(record.get(key) if record else None, digits)

    lines += _retention_section(records, methods, budgets, full)
    if has_memory_axis(records):
        lines += memory_markdown(records)
    lines += ["## Average score by budget", ""]
    header = ["method", *(budget_label(b) for b in budgets)] if budgets else ["method", "score"]
    rows = [[f"`{m}`", *(cell(m, b, AVERAGE_TASK) for b in budgets or [FULL_BUDGET])] for m in methods]
    lines += [markdown_table(header, rows), ""]
    if full and budgets:
        lines += ["(`full` is the same run in every column.)", ""]
    lines += ["## KV-cache size (compressed / full bytes)", ""]
    rows = [[f"`{m}`", *(cell(m, b, AVERAGE_TASK, "kv_ratio", 3) for b in budgets or [FULL_BUDGET])] for m in methods]
    lines += [markdown_table(header, rows), ""]
    for budget in budgets or [FULL_BUDGET]:
        lines += [f"## Budget {budget_label(budget)}: score by task", ""]
        header_t = ["method", *tasks, "**average**"]
        shown = [*full, *compressed] if budgets else methods
        rows = [
            [
                f"`{m}`" + (" (1.0)" if m in full and budgets else ""),
                *(cell(m, budget, t) for t in tasks),
                f"**{cell(m, budget, AVERAGE_TASK)}**",
            ]
            for m in shown
        ]
        lines += [markdown_table(header_t, rows), ""]
    n = {r["task"]: r["n"] for r in records if r["task"] not in SUMMARY_TASKS}
    lines += ["Samples per task: " + ", ".join(f"{t} {n[t]}" for t in tasks), ""]
    return "\n".join(lines)


def write_eval_report(
    out_dir: str | Path, records: Sequence[Mapping[str, Any]], title_info: Mapping[str, Any] | None = None
) -> list[Path]:
    """Write ``report.md``, ``scores.png`` (average) and ``scores_by_task.png`` into ``out_dir``.

    Returns:
        The written paths.
    """
    out_dir = Path(out_dir)
    report = out_dir / "report.md"
    body = eval_markdown(records, title_info)
    suffix = title_suffix(title_info)
    retention = [
        plot_retention(records, out_dir / "retention.png", title="Retention vs cache budget" + suffix),
        plot_retention(
            records, out_dir / "retention_time.png", against="time", title="Retention vs compression time" + suffix
        ),
    ]
    if retention[0] is not None:
        body += "\n![retention vs budget](retention.png)\n\n![retention vs compression time](retention_time.png)\n"
    if has_memory_axis(records):
        memory_plot = plot_retention_memory(
            records, out_dir / "retention_memory.png", title="Retention vs memory" + suffix
        )
        if memory_plot is not None:
            retention.append(memory_plot)
            body += "\n![retention vs memory](retention_memory.png)\n"
    body += "\n![average score vs budget](scores.png)\n\n![score vs budget by task](scores_by_task.png)\n"
    atomic_write_text(report, body)
    return [
        report,
        *(p for p in retention if p is not None),
        plot_scores(records, out_dir / "scores.png", title="Score vs cache budget" + suffix),
        plot_scores(
            records, out_dir / "scores_by_task.png", by_task=True, title="Score vs cache budget by task" + suffix
        ),
    ]
