"""Markdown tables and PNG plots for evaluation and fidelity results.

Eval (``report.md``, ``scores.png``, ``scores_by_task.png``): a summary table of average scores
(method × budget), the KV-cache size ratio per method × budget, and one table per budget with a
row per method and a column per task plus the average. Plots show score against budget per
method, ``full`` as a dashed horizontal line.

Fidelity (``fidelity.md``, ``fidelity.png``): relative attention-output error and NLL increase
per method × budget, per-layer errors, and both against budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "eval_markdown",
    "fidelity_markdown",
    "plot_fidelity",
    "plot_retention",
    "plot_scores",
    "write_eval_report",
    "write_fidelity_report",
]

AVERAGE_TASK = "average"
HEADLINE_TASK = "headline"
SUMMARY_TASKS = (AVERAGE_TASK, HEADLINE_TASK, f"{HEADLINE_TASK}_noise", f"{HEADLINE_TASK}_prose")
FULL_BUDGET = 1.0


# ------------------------------------------------------------------------------ helpers


def _is_full(record: Mapping[str, Any]) -> bool:
    """The uncompressed reference (``full`` at budget 1.0)."""
    from kvfold.methods import build_method

    try:
        return build_method(record["method"]).is_identity
    except ValueError:
        return False


def _budget_sort_key(budget: Any) -> tuple[int, float]:
    """Fractions first (ascending), then token counts (ascending)."""
    return (0, float(budget)) if isinstance(budget, float) else (1, float(budget))


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _budget_label(budget: Any) -> str:
    return f"{budget:g}" if isinstance(budget, float) else f"{budget} tok"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align_first_left: bool = True) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([":---" if align_first_left else "---:"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _ordered(values: Sequence[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _split(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[Any], list[str]]:
    """Methods (as first seen), compressed budgets (sorted) and tasks (as first seen, average last)."""
    methods = _ordered([r["method"] for r in records])
    budgets = sorted({r["budget"] for r in records if not _is_full(r)}, key=_budget_sort_key)
    tasks = [t for t in _ordered([r["task"] for r in records]) if t not in SUMMARY_TASKS]
    return methods, budgets, tasks


def _table_budgets(budgets: Sequence[Any]) -> list[Any]:
    """Budgets as table columns: from the mildest compression to the strongest."""
    return sorted(budgets, key=_budget_sort_key, reverse=True) or [FULL_BUDGET]


def _header_lines(title: str, info: Mapping[str, Any] | None) -> list[str]:
    lines = [f"# {title}", ""]
    if info:
        lines += [", ".join(f"**{k}**: {v}" for k, v in info.items() if v is not None), ""]
    return lines


# ------------------------------------------------------------------------------ eval


def _with_interval(value: float | None, interval: Sequence[float] | None, scale: float, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = f"{value * scale:.{digits}f}"
    if interval and not any(v is None or math.isnan(v) for v in interval):
        text += f" [{interval[0] * scale:.{digits}f}, {interval[1] * scale:.{digits}f}]"
    return text


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
                    _with_interval(r["retention"], r.get("retention_ci"), 100, 1),
                    _with_interval(r["score"], r.get("score_ci"), 1, 1),
                    _with_interval(noise.get("retention"), noise.get("retention_ci"), 100, 1),
                    _with_interval(prose.get("retention"), prose.get("retention_ci"), 100, 1),
                    _fmt(r.get("compress_over_prefill"), 2),
                ]
            )
        header = ["#", "method", "retention %", "score", "noise ret. %", "prose ret. %", "compress / prefill"]
        lines += [f"### Budget {_budget_label(budget)}", "", _table(header, rows), ""]
    reference = index.get((full[0], FULL_BUDGET, HEADLINE_TASK))
    if reference:
        lines += [f"`full` headline score: {_with_interval(reference['score'], reference.get('score_ci'), 1, 1)}.", ""]
    return lines


def eval_markdown(records: Sequence[Mapping[str, Any]], info: Mapping[str, Any] | None = None) -> str:
    """The eval report: summary (method × budget), KV ratio, then task tables per budget.

    Args:
        records: ``results.json`` records (with ``"average"`` task rows).
        info: run facts shown under the title (model, dataset, ...).
    """
    methods, budgets, tasks = _split(records)
    budgets = _table_budgets(budgets) if budgets else []
    mode = {bool(r.get("query_aware")) for r in records}
    index = {(r["method"], r["budget"], r["task"]): r for r in records}
    full = [m for m in methods if _is_full({"method": m})]
    compressed = [m for m in methods if m not in full]
    lines = _header_lines("kvfold eval", info)
    lines += [
        f"Protocol: {'query-aware' if mode == {True} else 'query-agnostic'}. Scores are 0–100 "
        "(mean over samples; the average is the macro average over tasks). "
        f"`full` is the uncompressed cache (budget {FULL_BUDGET:.1f}).",
        "",
    ]

    def cell(method: str, budget: Any, task: str, key: str = "score", digits: int = 1) -> str:
        record = index.get((method, FULL_BUDGET if method in full else budget, task))
        return _fmt(record.get(key) if record else None, digits)

    lines += _retention_section(records, methods, budgets, full)
    lines += ["## Average score by budget", ""]
    header = ["method", *(_budget_label(b) for b in budgets)] if budgets else ["method", "score"]
    rows = [[f"`{m}`", *(cell(m, b, AVERAGE_TASK) for b in budgets or [FULL_BUDGET])] for m in methods]
    lines += [_table(header, rows), ""]
    if full and budgets:
        lines += ["(`full` is the same run in every column.)", ""]
    lines += ["## KV-cache size (compressed / full bytes)", ""]
    rows = [[f"`{m}`", *(cell(m, b, AVERAGE_TASK, "kv_ratio", 3) for b in budgets or [FULL_BUDGET])] for m in methods]
    lines += [_table(header, rows), ""]
    for budget in budgets or [FULL_BUDGET]:
        lines += [f"## Budget {_budget_label(budget)}: score by task", ""]
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
        lines += [_table(header_t, rows), ""]
    n = {r["task"]: r["n"] for r in records if r["task"] not in SUMMARY_TASKS}
    lines += ["Samples per task: " + ", ".join(f"{t} {n[t]}" for t in tasks), ""]
    return "\n".join(lines)


def _axis_positions(budgets: Sequence[Any]) -> tuple[dict[Any, float], bool]:
    """x positions per budget: the fractions themselves, or evenly spaced when token counts appear."""
    numeric = all(isinstance(b, float) for b in budgets)
    return ({b: float(b) for b in budgets} if numeric else {b: float(i) for i, b in enumerate(budgets)}), numeric


def _budget_axis_label(numeric: bool) -> str:
    return "cache budget (fraction of the context kept)" if numeric else "cache budget"


def _style_budget_axis(ax: Any, budgets: Sequence[Any], numeric: bool) -> None:
    positions, _ = _axis_positions(budgets)
    ax.set_xticks([positions[b] for b in budgets], [_budget_label(b) for b in budgets])
    ax.set_xlabel(_budget_axis_label(numeric))
    if numeric:
        span = max(budgets) - min(budgets) if len(budgets) > 1 else 0.1
        ax.set_xlim(min(budgets) - 0.08 * span - 0.02, max(budgets) + 0.08 * span + 0.02)
    else:
        ax.set_xlim(-0.5, len(budgets) - 0.5)
    ax.grid(True, alpha=0.3)


def _draw_scores(
    ax: Any, records: Sequence[Mapping[str, Any]], task: str, budgets: Sequence[Any], colors: Mapping[str, Any]
) -> None:
    positions, _ = _axis_positions(budgets)
    for method, color in colors.items():
        points = sorted(
            ((r["budget"], r["score"]) for r in records if r["method"] == method and r["task"] == task),
            key=lambda p: _budget_sort_key(p[0]),
        )
        if not points:
            continue
        if _is_full({"method": method}):
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods, budgets, tasks = _split(records)
    budgets = budgets or [FULL_BUDGET]
    cmap = plt.get_cmap("tab10")
    colors = {m: cmap(i % 10) for i, m in enumerate(methods)}
    panels = tasks if by_task else [AVERAGE_TASK]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols if by_task else 7.5, 3.3 * rows if by_task else 5), squeeze=False, sharey=True
    )
    _, numeric = _axis_positions(budgets)
    for i, (ax, task) in enumerate(zip(axes.flat, panels, strict=False)):
        _draw_scores(ax, records, task, budgets, colors)
        _style_budget_axis(ax, budgets, numeric)
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
        fig.supxlabel(axes.flat[0].xaxis.get_label_text() or _budget_axis_label(numeric), y=0.35 / height)
        fig.suptitle(title, fontsize=13)
        fig.tight_layout(rect=(0, 0.65 / height, 1, 1 - 0.1 / height))
    else:
        axes.flat[0].legend(loc="best", fontsize=9)
        fig.suptitle(title, fontsize=13)
        fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (less time, more retention), by time."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in records
        if r["task"] == HEADLINE_TASK
        and r.get("retention") is not None
        and not _is_full(r)
    ]
    if not rows:
        return None
    methods = _ordered([r["method"] for r in rows])
    budgets = sorted({r["budget"] for r in rows}, key=_budget_sort_key)
    cmap = plt.get_cmap("tab20")
    markers = "os^Dv<>p*hX"
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    positions, numeric = _axis_positions(budgets)
    for i, method in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: _budget_sort_key(r["budget"]))
        ys = [100 * r["retention"] for r in mine]
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
        errors = [[0.0 if math.isnan(e) else e for e in side] for side in errors]
        if against == "time":
            for r, y, lo, hi in zip(mine, ys, *errors, strict=True):
                ax.errorbar(
                    r.get("compress_over_prefill", math.nan),
                    y,
                    yerr=[[lo], [hi]],
                    color=cmap(i % 20),
                    marker=markers[budgets.index(r["budget"]) % len(markers)],
                    capsize=2,
                    linestyle="none",
                    label=method if r is mine[0] else None,
                )
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
        ax.set_xlabel(
            "compression time / prefill time of the same context (marker shape = budget: "
            + ", ".join(f"{markers[i % len(markers)]} {_budget_label(b)}" for i, b in enumerate(budgets))
            + ")"
        )
    else:
        _style_budget_axis(ax, budgets, numeric)
    ax.set_ylabel("headline retention (% of the full cache's score)")
    ax.set_ylim(-3, 110)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.suptitle(
        title or ("Retention vs compression time" if against == "time" else "Retention vs cache budget"), fontsize=12
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    suffix = _title_suffix(title_info)
    retention = [
        plot_retention(records, out_dir / "retention.png", title="Retention vs cache budget" + suffix),
        plot_retention(
            records, out_dir / "retention_time.png", against="time", title="Retention vs compression time" + suffix
        ),
    ]
    if retention[0] is not None:
        body += "\n![retention vs budget](retention.png)\n\n![retention vs compression time](retention_time.png)\n"
    body += "\n![average score vs budget](scores.png)\n\n![score vs budget by task](scores_by_task.png)\n"
    report.write_text(body, encoding="utf-8")
    return [
        report,
        *(p for p in retention if p is not None),
        plot_scores(records, out_dir / "scores.png", title="Score vs cache budget" + suffix),
        plot_scores(
            records, out_dir / "scores_by_task.png", by_task=True, title="Score vs cache budget by task" + suffix
        ),
    ]


def _title_suffix(info: Mapping[str, Any] | None) -> str:
    """`` — dataset @ length, model`` from the run facts that are known."""
    if not info:
        return ""
    dataset = str(info.get("dataset") or "")
    if dataset and info.get("length"):
        dataset += f" @ {info['length']} tokens"
    parts = [p for p in (Path(dataset).name if dataset.endswith(".jsonl") else dataset, info.get("model")) if p]
    return " — " + ", ".join(map(str, parts)) if parts else ""


# ------------------------------------------------------------------------------ fidelity


def fidelity_markdown(records: Sequence[Mapping[str, Any]], info: Mapping[str, Any] | None = None) -> str:
    """The fidelity report: rel_error, block_error, nll_delta and KL per method × budget, then per-layer errors.

    Records of an online run with ``"online_path": false`` (a method with no decode-time policy) are
    listed apart, not measured.
    """
    unmeasured = [r for r in records if r.get("online_path") is False and "rel_error" not in r]
    records = [r for r in records if r not in unmeasured]
    online = bool(info and info.get("online"))
    methods = _ordered([r["method"] for r in records])
    budgets = _table_budgets({r["budget"] for r in records if not _is_full(r)})
    index = {(r["method"], r["budget"]): r for r in records}
    full = {m for m in methods if _is_full({"method": m})}
    lines = _header_lines("kvfold fidelity", info)
    lines += [
        "`rel_error`: ‖o − o_full‖ / ‖o_full‖ of the pre-o_proj attention outputs of the continuation, "
        "averaged over layers. `block_error`: the same error of the context block's own attention output "
        "over the full run's continuation queries (no propagation from earlier layers). "
        "`nll_delta`: mean NLL increase (nats/token) of the continuation's scored "
        "tokens. `kl`: mean KL(full ‖ compressed) of their next-token distributions. "
        "`full` is measured once (budget 1.0) and repeated in every column.",
        "",
    ]
    if online:
        lines += [
            "**Online**: each method's decode-time policy ran while the continuation was teacher-forced "
            "(the prompt in one forward, then one token a forward, the cache held at its budget), and the "
            "full cache was fed on the same schedule. `block_error` is that of the compressed prefill cache.",
            "",
        ]
    if unmeasured:
        names = ", ".join(f"`{m}`" for m in _ordered([r["method"] for r in unmeasured]))
        lines += [f"No online path (not measured, not run offline in its place): {names}.", ""]
    header = ["method", *(_budget_label(b) for b in budgets)]

    def cell(method: str, budget: Any, key: str) -> str:
        record = index.get((method, FULL_BUDGET if method in full else budget))
        return "–" if record is None else f"{record[key]:.3g}" if key != "kv_ratio" else f"{record[key]:.3f}"

    for key, title in (
        ("rel_error", "Relative attention-output error"),
        ("block_error", "Relative error of the context block's attention output"),
        ("nll_delta", "NLL increase (nats/token)"),
        ("kl", "KL(full ‖ compressed) (nats/token)"),
        ("kv_ratio", "KV-cache size (compressed / full)"),
    ):
        if not all(key in r for r in records):
            continue
        lines += [
            f"## {title}",
            "",
            _table(header, [[f"`{m}`", *(cell(m, b, key) for b in budgets)] for m in methods]),
            "",
        ]
    layered = [r for r in records if r.get("per_layer") and not _is_full(r)]
    if layered:
        n_layers = len(layered[0]["per_layer"])
        lines += ["## Relative error per layer", ""]
        header_l = ["layer", *(f"`{r['method']}` @ {_budget_label(r['budget'])}" for r in layered)]
        rows = [[str(i), *(f"{r['per_layer'][i]:.3g}" for r in layered)] for i in range(n_layers)]
        lines += [_table(header_l, rows), ""]
    lines += ["Samples: " + ", ".join(sorted({str(r["n"]) for r in records})), ""]
    return "\n".join(lines)


def plot_fidelity(
    records: Sequence[Mapping[str, Any]], path: str | Path, title: str = "Fidelity vs cache budget"
) -> Path:
    """Two panels against budget per method: rel_error and nll_delta (``full`` dashed at its value, 0).

    The error axis is logarithmic when the errors span more than a factor of 20, linear from 0 otherwise.

    Returns:
        The PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    records = [r for r in records if "rel_error" in r]  # online runs: methods with no online path
    methods = _ordered([r["method"] for r in records])
    budgets = sorted({r["budget"] for r in records if not _is_full(r)}, key=_budget_sort_key) or [FULL_BUDGET]
    positions, numeric = _axis_positions(budgets)
    cmap = plt.get_cmap("tab10")
    fig, (ax_err, ax_nll) = plt.subplots(1, 2, figsize=(12, 4.8))
    positive = [r["rel_error"] for r in records if r["rel_error"] > 0]
    log_scale = bool(positive) and max(positive) / min(positive) > 20
    for i, method in enumerate(methods):
        color = cmap(i % 10)
        points = sorted(
            ((r["budget"], r) for r in records if r["method"] == method), key=lambda p: _budget_sort_key(p[0])
        )
        if _is_full({"method": method}):
            record = points[0][1]
            label = f"{method} (reference)"
            ax_nll.axhline(record["nll_delta"], color=color, linestyle="--", label=label)
            if log_scale:
                ax_err.plot([], [], color=color, linestyle="--", label=f"{label}: 0")
            else:
                ax_err.axhline(record["rel_error"], color=color, linestyle="--", label=label)
            continue
        xs = [positions[b] for b, _ in points if b in positions]
        ax_err.plot(xs, [r["rel_error"] for b, r in points if b in positions], marker="o", color=color, label=method)
        ax_nll.plot(xs, [r["nll_delta"] for b, r in points if b in positions], marker="o", color=color, label=method)
    if log_scale:
        ax_err.set_yscale("log")
        ax_err.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    else:
        ax_err.set_ylim(bottom=0)
    ax_err.set_ylabel("relative error ‖o − o_full‖ / ‖o_full‖")
    ax_err.set_title("attention-output error (layer average)")
    ax_nll.set_ylabel("NLL increase (nats / token)")
    ax_nll.set_title("continuation NLL vs full cache")
    for ax in (ax_err, ax_nll):
        _style_budget_axis(ax, budgets, numeric)
        ax.legend(loc="best", fontsize=9)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_fidelity_report(
    out_dir: str | Path, records: Sequence[Mapping[str, Any]], title_info: Mapping[str, Any] | None = None
) -> list[Path]:
    """Write ``fidelity.md`` and ``fidelity.png`` into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    report = out_dir / "fidelity.md"
    report.write_text(
        fidelity_markdown(records, title_info) + "\n![fidelity vs budget](fidelity.png)\n", encoding="utf-8"
    )
    title = ("Online fidelity" if title_info and title_info.get("online") else "Fidelity") + " vs cache budget"
    return [report, plot_fidelity(records, out_dir / "fidelity.png", title=title + _title_suffix(title_info))]
