"""The merge-map report: the carrier-load table (``mergemap.md``), the merge maps and load curves (PNG).

Drawn from the records of :func:`kvfold.evaluate.diagnostics.mergemap.merge_maps`: GRKV's Figure 1
per method (``papers/grkv.md``, §1) and Lorenz-style curves of how the load concentrates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvfold.evaluate.diagnostics.concentration import LORENZ_POINTS
from kvfold.evaluate.reporting.plots import pyplot, save_figure
from kvfold.evaluate.reporting.tables import markdown_table

__all__ = ["mergemap_markdown", "plot_carrier_load", "plot_merge_maps", "short_number"]


def short_number(value: Any, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits (other values as they are); ``–`` when missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


COLUMNS = (
    "method", "kv", "evicted/head", "merged", "active", "top 1%", "top 10%", "Gini", "max/mean", "boundary",
    "updated", "‖Δk‖/‖k‖", "‖Δv‖/‖v‖", "‖Δv‖ top 10%", "‖Δv‖ Gini",
)  # fmt: skip
"""The columns of the carrier-load table."""


def _row(r: Mapping[str, Any]) -> list[str]:
    """One method's cells of the carrier-load table."""
    s = r["summary"]
    if not r.get("recorded", True):
        return [f"`{r['method']}`", f"{r['kv_ratio']:.3f}", "records no merge map", *["–"] * 12]
    boundary = "–" if s.get("boundary_share") is None else (f"{s['boundary_share']:.2f} ({s['boundary_fraction']:.2f})")
    return [
        f"`{r['method']}`",
        f"{r['kv_ratio']:.3f}",
        short_number(s["evicted"], 4),
        short_number(s.get("merged_fraction")),
        short_number(s.get("active")),
        short_number(s.get("top1_share")),
        short_number(s.get("top10_share")),
        short_number(s.get("gini")),
        short_number(s.get("max_over_mean")),
        boundary,
        short_number(s.get("updated")),
        short_number(s.get("dk_rel_mean")),
        short_number(s.get("dv_rel_mean")),
        short_number(s.get("dv_top10_share")),
        short_number(s.get("dv_gini")),
    ]


def mergemap_markdown(records: Sequence[Mapping[str, Any]], plot: Mapping[str, Any], info: Mapping[str, Any]) -> str:
    """The carrier-load report (one row per method) with the plots below it."""
    lines = ["# kvfold mergemap", ""]
    lines += [", ".join(f"{k}: {v}" for k, v in info.items()), ""]
    lines += [
        "Per layer and KV head, each retained entry's **load** is the number of evicted tokens it absorbed "
        "(fractions when a token is spread over several carriers). Pair measures are means over the heads "
        "that merged anything: `merged` = absorbed / evicted, `active` = retained entries with a load, "
        "`top 1%` / `top 10%` = share of the load on the most loaded 1% / 10% of retained entries, "
        "`Gini` of the loads, `max/mean` = largest load over the mean load, `boundary` = share of the load on "
        "the first/last entry of a retained span (with the share of retained entries that are boundaries). "
        "Update measures (every method, GRKV included): `‖Δv‖ top 10%` and `‖Δv‖ Gini` over the retained "
        "entries' value changes, `updated` = retained entries that changed, `‖Δk‖/‖k‖`, `‖Δv‖/‖v‖` means.",
        "",
        markdown_table(COLUMNS, [_row(r) for r in records]),
    ]
    lines += [
        "",
        f"Merge map: layer {plot['layer']}, KV head {plot['head']} (first context).",
        "",
        "![merge maps](mergemap.png)",
        "",
        "![carrier load](carrier_load.png)",
        "",
    ]
    return "\n".join(lines)


def _spans(retained: Sequence[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for p in retained:
        if spans and p == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], p)
        else:
            spans.append((p, p))
    return spans


def plot_merge_maps(plot: Mapping[str, Any], path: str | Path) -> Path:
    """GRKV Figure 1 per method: x = retained carrier position, y = absorbed (evicted) position,
    colour = key cosine similarity, black bars = retained spans. Methods with no pairs show their
    update magnitudes ``‖Δk‖``, ``‖Δv‖`` per retained position instead."""
    plt = pyplot()
    maps = plot["maps"]
    names = list(maps)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows), squeeze=False)
    scatter = None
    for ax, name in zip(axes.flat, names, strict=False):
        head = maps[name]
        ax.set_title(f"{name}", fontsize=10)
        if head is None or head == "unrecorded":
            text = "nothing evicted in this layer/head" if head is None else "this method records no merge map"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        retained = head["retained"]
        top = max([*retained, *(p[1] for p in head["pairs"]), 1])
        if head["pairs"]:
            pairs = np.asarray(head["pairs"], dtype=np.float64)
            scatter = ax.scatter(
                pairs[:, 0], pairs[:, 1], c=pairs[:, 3], s=6, cmap="viridis", vmin=-1, vmax=1, linewidths=0
            )
            ax.plot([0, top], [0, top], "--", color="gray", linewidth=0.7)
            ax.set_ylabel("absorbed (evicted) token position")
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [-0.02 * top] * 2, color="black", linewidth=3, solid_capstyle="butt")
            ax.set_ylim(-0.05 * top, top * 1.02)
        elif head["value_change"] is not None and sum(head["value_change"]) > 0:
            ax.vlines(retained, 0, head["value_change"], color="tab:red", linewidth=0.6, label="‖Δv‖")
            ax.vlines(np.asarray(retained) + 0.3, 0, head["key_change"], color="tab:blue", linewidth=0.6, label="‖Δk‖")
            ax.legend(fontsize=8, loc="upper left")
            ax.set_ylabel("update magnitude of the retained entry")
            ymax = max(max(head["value_change"]), max(head["key_change"]), 1e-12)
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [-0.03 * ymax] * 2, color="black", linewidth=3, solid_capstyle="butt")
        else:
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [0, 0], color="black", linewidth=3, solid_capstyle="butt")
            ax.text(
                0.5,
                0.5,
                "no merge and no update\nin this layer and head",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_yticks([])
        ax.set_xlim(-0.01 * top, top * 1.01)
        ax.set_xlabel("retained (carrier) token position")
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if scatter is not None:
        fig.colorbar(scatter, ax=axes.ravel().tolist(), shrink=0.8, label="key cosine similarity")
    fig.suptitle(f"Merge maps, layer {plot['layer']}, KV head {plot['head']} (black bars: retained spans)")
    return save_figure(fig, path, tight_box=True)


def plot_carrier_load(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Lorenz-style curves: share of the load held by the most loaded fraction of retained entries
    (solid: merge loads; dashed: ‖Δv‖), mean over layers and heads; the diagonal is an even load."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    grid = np.linspace(0.0, 1.0, LORENZ_POINTS)
    cmap = plt.get_cmap("tab10")
    for i, r in enumerate(records):
        color = cmap(i % 10)
        if r["lorenz"].get("merge") is not None:
            ax.plot(grid, r["lorenz"]["merge"], color=color, label=f"{r['method']} (merges)")
        if r["lorenz"].get("value_update") is not None:
            ax.plot(grid, r["lorenz"]["value_update"], color=color, linestyle="--", label=f"{r['method']} (‖Δv‖)")
    ax.plot([0, 1], [0, 1], ":", color="gray", label="even load")
    ax.set_xlabel("fraction of retained entries (most loaded first)")
    ax.set_ylabel("share of the load")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Carrier load concentration")
    return save_figure(fig, path, tight_box=True)
