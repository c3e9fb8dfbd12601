"""The report of ``kvfold bench``: its result read back, several merged, as Markdown and as plots.

A finished bench writes ``bench.json`` (:data:`BENCH_FILE`), ``bench.md`` (:func:`bench_markdown`: one
row per configuration), ``bench.png`` (decode throughput and peak memory against the length) and,
where the compression's peak was measured, ``scaling.png`` (:func:`write_bench_report`); ``kvfold
report`` reads such folders back (:func:`read_bench_run`) and merges the benches of one model
(:func:`merge_bench_results`). What the columns mean: :mod:`kvfold.evaluate.bench.speed`.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfold.evaluate.bench.records import STOCK, compression_ratios, config_key
from kvfold.evaluate.reporting.plots import save_figure
from kvfold.evaluate.reporting.tables import markdown_table
from kvfold.runtime.errors import UserError
from kvfold.runtime.files import atomic_write_text

BENCH_FILE = "bench.json"
"""The result of a finished bench, in its ``--out`` folder (``kvfold report`` reads it back)."""


def read_bench_run(out_dir: str | Path) -> dict:
    """The result a finished ``kvfold bench`` wrote into ``out_dir`` (``{"model", "records"}``).

    Raises:
        ValueError: no ``bench.json`` there (a bench not finished, or not a bench folder), or a
            damaged one.
    """
    path = Path(out_dir) / BENCH_FILE
    if not path.is_file():
        raise UserError(f"{out_dir} holds no {BENCH_FILE}: not a finished kvfold bench --out folder (rerun it)")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({err}): it was edited or damaged; rerun the bench") from None
    if not isinstance(result, dict) or not isinstance(result.get("records"), list):
        raise UserError(f"{path} has no records: not written by kvfold bench")
    return result


def merge_bench_results(results: list[dict]) -> dict:
    """Several benches of one model as one: their records together, a configuration measured twice
    taken from the first (``full`` is measured by every bench).

    Raises:
        ValueError: benches of different models (their speeds do not compare).
    """
    models = list(dict.fromkeys(str(r.get("model")) for r in results))
    if len(models) > 1:
        raise UserError(f"the bench folders measured different models ({', '.join(models)}); report them apart")
    kept: dict[str, dict] = {}
    for result in results:
        for record in result["records"]:
            kept.setdefault(config_key(record), record)
    return {"model": models[0], "records": list(kept.values())}


def bench_markdown(result: dict) -> str:
    """The page ``bench.md`` holds: a heading, how to read the columns, one row per configuration."""
    rows = sorted(result["records"], key=lambda r: (r["batch"], r["length"], r["method"], str(r["budget"])))
    lines = [
        f"# kvfold bench — {result['model']}",
        "",
        "Decode throughput is steady state (after warm-up, prefill excluded), summed over the batch. "
        "Decode speed is the batch over the median step time. "
        "`speedup` is against `full` at the same length; `limit` is `full` at the compressed size against "
        "`full` at the length (the ceiling); `full` at the compressed size decodes in the method's own process, "
        "step for step with it, so `speedup/limit` is a paired ratio. Peak RSS is each configuration's own "
        "process (prefill and compression). `repeat s` is the repeat pass alone (methods that run it); "
        "`c/prefill` and `c/repeat` are the compression time over the prefill and over the repeat pass; "
        "`c peak/cache` is the compression's peak memory over the prefilled process, over the full cache's bytes. "
        "`KV MB` is what the cache holds here (codes, scales, β; capacity and page rounding apart); `of 16-bit` "
        "is the cache's bytes over the full cache's at 16 bits (unquantized elements counted at 16 bits).",
        "",
        markdown_table(BENCH_COLUMNS, map(_bench_row, rows)),
    ]
    if result.get("ray_workers"):
        lines += [
            "",
            "Measured on Ray workers (each a machine's share: a `speedup` divides by the `full` measured by the "
            "same worker; workers on one machine contend):",
            "",
            *(f"* {what}: `{worker}`" for what, worker in result["ray_workers"].items()),
        ]
    return "\n".join(lines) + "\n"


def write_bench_report(result: dict, out_dir: Path) -> None:
    """``bench.json``, ``bench.md`` (a table) and ``bench.png`` (throughput and memory vs length)."""
    atomic_write_text(out_dir / BENCH_FILE, json.dumps(result, indent=2))
    atomic_write_text(out_dir / "bench.md", bench_markdown(result))
    rows = sorted(result["records"], key=lambda r: (r["batch"], r["length"], r["method"], str(r["budget"])))
    _plot(rows, out_dir / "bench.png")
    if any(r.get("compress_peak_over_cache") is not None for r in rows):
        _plot_scaling(rows, out_dir / "scaling.png")


BENCH_COLUMNS = (
    "method", "budget", "length", "batch", "prefill s", "compress s", "repeat s", "c/prefill", "c/repeat",
    "decode tok/s", "speedup", "limit", "speedup/limit", "KV MB", "full KV MB", "of 16-bit", "format",
    "peak RSS MB", "c peak/cache",
)  # fmt: skip


def _bench_row(r: dict) -> list[str]:
    ratios = compression_ratios(r)
    return [
        _method_cell(r), str(r["budget"]), str(r["length"]), str(r["batch"]), f"{r['prefill_s']:.2f}",
        f"{r['compress_s']:.2f}", _cell(r.get("repeat_s")), _cell(ratios["compress_over_prefill"]),
        _cell(ratios["compress_over_repeat"]), f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
        f"{r['limit_speedup']:.2f}", f"{r['speedup_over_limit']:.2f}", f"{r['kv_bytes'] / 2**20:.1f}",
        f"{r['kv_bytes_full'] / 2**20:.1f}", _memory_cell(r), r.get("kv_format", "16"), f"{r['peak_rss_mb']:.0f}",
        _cell(r.get("compress_peak_over_cache")),
    ]  # fmt: skip


def _method_cell(r: dict) -> str:
    """The method, marked where kvfold's decode ran compiled (stock's own steps are what :data:`STOCK` says)."""
    return r["method"] + (" (compiled)" if r.get("compiled") and r["method"] not in STOCK else "")


def _memory_cell(r: dict) -> str:
    """The cache's bytes over the 16-bit full cache's (records of an older kvfold: unquantized, so
    their ratio in the model's dtype)."""
    ratio = r.get("memory_ratio", r["kv_bytes"] / r["kv_bytes_full"])
    return f"{ratio:.4f}"


def _cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        series: dict[str, list[dict]] = {}
        for r in rows:
            if r["batch"] == batch:
                label = r["method"] if r["method"] == "full" else f"{r['method']} @ {r['budget']}"
                series.setdefault(label, []).append(r)
        for label, points in sorted(series.items()):
            points.sort(key=lambda r: r["length"])
            style = {"linestyle": "--", "color": "black"} if label == "full" else {"marker": "o"}
            lengths = [p["length"] for p in points]
            axes[0][col].plot(lengths, [p["decode_tokens_per_s"] for p in points], label=label, **style)
            axes[1][col].plot(lengths, [p["peak_rss_mb"] for p in points], label=label, **style)
        axes[0][col].set_title(f"decode throughput, batch {batch}")
        axes[0][col].set_ylabel("tokens / s (summed over batch)")
        axes[1][col].set_title(f"peak resident memory, batch {batch}")
        axes[1][col].set_ylabel("MB")
        for row in (0, 1):
            axes[row][col].set_xlabel("context length (tokens)")
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].grid(True, alpha=0.3)
            axes[row][col].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _plot_scaling(rows: list[dict], path: Path) -> None:
    """Compression ÷ prefill and the compression's peak memory ÷ the full cache against the length,
    one line per method @ budget and batch (records without the measures are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = (
        ("compress_over_prefill", "compression ÷ prefill (time)"),
        ("compress_peak_over_cache", "compression peak memory ÷ full cache"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, (name, title) in zip(axes, measures, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            value = {**r, **compression_ratios(r)}.get(name)
            if r["method"] != "full" and value is not None:
                series.setdefault(f"{r['method']} @ {r['budget']} ×{r['batch']}", []).append((r["length"], value))
        for label, points in sorted(series.items()):
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        axis.set_title(title)
        axis.set_xlabel("context length (tokens)")
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        if series:
            axis.legend(fontsize=7)
        else:  # e.g. stock transformers only: nothing compressed
            axis.text(0.5, 0.5, "no compression measured", ha="center", va="center", transform=axis.transAxes)
    fig.tight_layout()
    save_figure(fig, path)
