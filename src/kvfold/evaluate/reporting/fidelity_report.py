"""The fidelity report (``fidelity.md`` and ``fidelity.png``) from ``fidelity.json`` records.

Relative attention-output error, block error, NLL increase and KL per method × budget, per-layer
errors, and error and NLL increase against budget (:mod:`kvfold.evaluate.running.fidelity`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfold.evaluate.reporting.plots import axis_positions, pyplot, save_figure, style_budget_axis, title_suffix
from kvfold.evaluate.reporting.tables import (
    FULL_BUDGET,
    budget_label,
    budget_sort_key,
    header_lines,
    markdown_table,
    ordered,
    table_budgets,
)
from kvfold.evaluate.scoring.records import names_full
from kvfold.runtime.files import atomic_write_text

__all__ = ["fidelity_markdown", "plot_fidelity", "write_fidelity_report"]


def fidelity_markdown(records: Sequence[Mapping[str, Any]], info: Mapping[str, Any] | None = None) -> str:
    """The fidelity report: rel_error, block_error, nll_delta and KL per method × budget, then per-layer errors.

    Records of an online run with ``"online_path": false`` (a method with no decode-time policy) are
    listed apart, not measured.
    """
    unmeasured = [r for r in records if r.get("online_path") is False and "rel_error" not in r]
    records = [r for r in records if r not in unmeasured]
    online = bool(info and info.get("online"))
    methods = ordered([r["method"] for r in records])
    budgets = table_budgets({r["budget"] for r in records if not names_full(r["method"])})
    index = {(r["method"], r["budget"]): r for r in records}
    full = {m for m in methods if names_full(m)}
    lines = header_lines("kvfold fidelity", info)
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
        names = ", ".join(f"`{m}`" for m in ordered([r["method"] for r in unmeasured]))
        lines += [f"No online path (not measured, not run offline in its place): {names}.", ""]
    header = ["method", *(budget_label(b) for b in budgets)]

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
            markdown_table(header, [[f"`{m}`", *(cell(m, b, key) for b in budgets)] for m in methods]),
            "",
        ]
    layered = [r for r in records if r.get("per_layer") and not names_full(r["method"])]
    if layered:
        n_layers = len(layered[0]["per_layer"])
        lines += ["## Relative error per layer", ""]
        header_l = ["layer", *(f"`{r['method']}` @ {budget_label(r['budget'])}" for r in layered)]
        rows = [[str(i), *(f"{r['per_layer'][i]:.3g}" for r in layered)] for i in range(n_layers)]
        lines += [markdown_table(header_l, rows), ""]
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
    from matplotlib.ticker import FuncFormatter

    plt = pyplot()

    records = [r for r in records if "rel_error" in r]  # online runs: methods with no online path
    methods = ordered([r["method"] for r in records])
    compressed = {r["budget"] for r in records if not names_full(r["method"])}
    budgets = sorted(compressed, key=budget_sort_key) or [FULL_BUDGET]
    positions, numeric = axis_positions(budgets)
    cmap = plt.get_cmap("tab10")
    fig, (ax_err, ax_nll) = plt.subplots(1, 2, figsize=(12, 4.8))
    positive = [r["rel_error"] for r in records if r["rel_error"] > 0]
    log_scale = bool(positive) and max(positive) / min(positive) > 20
    for i, method in enumerate(methods):
        color = cmap(i % 10)
        points = sorted(
            ((r["budget"], r) for r in records if r["method"] == method), key=lambda p: budget_sort_key(p[0])
        )
        if names_full(method):
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
        style_budget_axis(ax, budgets, numeric)
        ax.legend(loc="best", fontsize=9)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    return save_figure(fig, path)


def write_fidelity_report(
    out_dir: str | Path, records: Sequence[Mapping[str, Any]], title_info: Mapping[str, Any] | None = None
) -> list[Path]:
    """Write ``fidelity.md`` and ``fidelity.png`` into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    report = out_dir / "fidelity.md"
    atomic_write_text(report, fidelity_markdown(records, title_info) + "\n![fidelity vs budget](fidelity.png)\n")
    title = ("Online fidelity" if title_info and title_info.get("online") else "Fidelity") + " vs cache budget"
    return [report, plot_fidelity(records, out_dir / "fidelity.png", title=title + title_suffix(title_info))]
