"""The tables of a results page, generated from small result summaries kept in the repository.

A *summary* is a JSON file under ``docs/results/data/`` that keeps, of one or more finished runs,
only what a current-numbers page shows: the headline and average records of ``kvfold eval`` runs,
or the records of ``kvfold bench`` directories, with the runs' configuration and the command that
made them. A *page* marks where each table goes::

    <!-- table: ruler-2k retention -->
    (generated: do not edit)
    <!-- /table -->

and ``render`` rewrites what lies between the marks from ``docs/results/data/ruler-2k.json``.
Table kinds: ``retention`` (method × budget, headline retention with its 95% interval),
``memory`` (method × memory budget: retention and the bytes held, a quantization-only run at its own),
``cost`` (bench: compression ÷ prefill, compression peak ÷ full cache, decode speed-up, KV size by
method and length).

usage:
    python tools/current_results.py summarize NAME RUN_DIR... [--command CMD] [--data DIR]
    python tools/current_results.py render PAGE.md [--data DIR] [--check]
    python tools/current_results.py difference RUN_DIR... --first METHOD@BUDGET --second METHOD@BUDGET

``summarize`` merges the runs as ``kvfold report`` does (eval runs of one configuration, or bench
directories of one model) and writes ``DIR/NAME.json``; ``render --check`` changes nothing and
exits 1 when the page is not what its summaries render (a test runs it on the repository's pages).
``difference`` prints the headline retention of one (method, budget) minus another's on the same
samples of eval runs, with its paired 95% interval
(:func:`kvfold.evaluate.scoring.records.headline_difference`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "data"
MARK = re.compile(r"<!-- table: (?P<name>[\w.-]+) (?P<kind>\w+) -->\n(?P<body>.*?)<!-- /table -->", re.S)
EVAL_TASKS = ("headline", "headline_noise", "headline_prose", "average")
"""The eval records a summary keeps (every task's own record stays in the run's results.json)."""


def summarize(runs: Sequence[Path], command: str | None = None) -> dict[str, Any]:
    """The summary of finished runs: all eval runs of one configuration, or bench directories of one model.

    Raises:
        ValueError: a directory that is neither, runs of several kinds or configurations.
    """
    from kvfold.evaluate.bench.report import BENCH_FILE, merge_bench_results, read_bench_run
    from kvfold.evaluate.running.results import merge_runs, read_run

    sources = [str(path) for path in runs]
    benches = [path for path in runs if (path / BENCH_FILE).is_file()]
    if benches and len(benches) != len(runs):
        raise ValueError("summarize eval runs and bench directories apart (one summary each)")
    if benches:
        result = merge_bench_results([read_bench_run(path) for path in benches])
        summary = {"kind": "bench", "config": {"model": result["model"]}, "records": result["records"]}
    else:
        read = [read_run(path) for path in runs]
        if any(run.kind.name != "eval" for run in read):
            raise ValueError("only kvfold eval runs and kvfold bench directories are summarized")
        records, config = merge_runs(read)
        kept = [r for r in records if r["task"] in EVAL_TASKS]
        summary = {"kind": "eval", "config": config, "records": kept}
    summary["sources"] = sources
    if command:
        summary["command"] = command
    return summary


def retention_table(summary: Mapping[str, Any]) -> str:
    """Method × budget: headline retention (%) with its 95% interval, best first at the first budget."""
    from kvfold.evaluate.reporting.tables import format_interval, markdown_table

    headline = [r for r in summary["records"] if r["task"] == "headline" and r.get("retention") is not None]
    if not headline:
        raise ValueError("no headline retention in this summary (no full run, or the full cache solves no task)")
    budgets = sorted({r["budget"] for r in headline}, key=lambda b: -float(b))
    index = {(r["method"], r["budget"]): r for r in headline}
    methods = list(dict.fromkeys(r["method"] for r in headline))
    first = budgets[0]
    methods.sort(key=lambda m: -(index[(m, first)]["retention"] if (m, first) in index else -1.0))
    rows = []
    for method in methods:
        cells = []
        for budget in budgets:
            record = index.get((method, budget))
            cells.append(
                "—" if record is None else format_interval(record["retention"], record.get("retention_ci"), 100, 1)
            )
        rows.append([f"`{method}`", *cells])
    return markdown_table(["method", *(f"keep {b}" for b in budgets)], rows)


def cost_table(summary: Mapping[str, Any]) -> str:
    """Bench records by method and length: compression time and peak over the prefill's and the cache's."""
    from kvfold.evaluate.bench.records import compression_ratios
    from kvfold.evaluate.reporting.tables import markdown_table

    def cell(value: float | None, digits: int = 2, suffix: str = "×") -> str:
        return "—" if value is None else f"{value:.{digits}f}{suffix}"

    records = sorted(summary["records"], key=lambda r: (r["method"] != "full", r["method"], r["length"], r["batch"]))
    rows = []
    for r in records:
        ratios = compression_ratios(r)
        rows.append(
            [
                f"`{r['method']}`",
                str(r["budget"]),
                f"{r['length']:,}",
                str(r["batch"]),
                cell(ratios.get("compress_over_prefill")),
                cell(r.get("compress_peak_over_cache")),
                cell(r.get("speedup")),
                cell(r.get("speedup_over_limit")),
                f"{r['kv_bytes'] / 2**20:.1f}",
                f"{r.get('memory_ratio', r['kv_bytes'] / r['kv_bytes_full']):.4f}",
                r.get("kv_format", "16"),
            ]
        )
    header = [
        "method",
        "budget",
        "tokens",
        "batch",
        "compress ÷ prefill",
        "peak ÷ full cache",
        "decode speed-up",
        "decode ÷ same entries in full precision",
        "KV MB",
        "of 16-bit",
        "format",
    ]
    return markdown_table(header, rows)


def memory_table(summary: Mapping[str, Any]) -> str:
    """Method × memory: headline retention (%) with its 95% interval and the memory the cache held
    (a fraction of the 16-bit full cache); quantization-only runs (``full@int4``) at their own memory."""
    from kvfold.evaluate.reporting.tables import format_interval, markdown_table

    headline = [r for r in summary["records"] if r["task"] == "headline" and r.get("retention") is not None]
    if not headline:
        raise ValueError("no headline retention in this summary (no full run, or the full cache solves no task)")
    asked = sorted({r["memory"] for r in headline if r.get("memory") is not None}, reverse=True)
    index = {(r["method"], r.get("memory")): r for r in headline}
    methods = list(dict.fromkeys(r["method"] for r in headline if r.get("memory") is not None))
    rows = []
    for method in methods:
        cells = []
        for memory in asked:
            record = index.get((method, memory))
            ratio = None if record is None else record.get("memory_ratio")
            held = "" if ratio is None else f" (1/{1 / ratio:.0f})"
            cells.append(
                "—"
                if record is None
                else format_interval(record["retention"], record.get("retention_ci"), 100, 1) + held
            )
        rows.append([f"`{method}`", *cells])
    quantized_only = [r for r in headline if r.get("memory") is None and r.get("kv_format", "16") != "16"]
    for record in sorted(quantized_only, key=lambda r: -r.get("memory_ratio", 1)):
        ratio = record.get("memory_ratio", 1.0)
        cell = format_interval(record["retention"], record.get("retention_ci"), 100, 1) + f" at 1/{1 / ratio:.1f}"
        rows.append([f"`{record['method']}` (every token)", *([cell] + ["" for _ in asked[1:]])])
    header = ["method", *(f"memory 1/{1 / m:.0f}" for m in asked)]
    return markdown_table(header, rows)


def difference(runs: Sequence[Path], first: str, second: str) -> str:
    """One line: ``first − second`` headline retention in points, its paired 95% interval, the tasks.

    ``first`` and ``second`` are ``METHOD@BUDGET`` (the budget as the runs name it: a memory run's
    memory fraction).

    Raises:
        ValueError: a side the runs do not hold.
    """
    from kvfold.evaluate.running.results import read_run
    from kvfold.evaluate.scoring.records import headline_difference
    from kvfold.runtime.files import read_jsonl

    predictions = []
    for run in runs:
        read_run(run)  # refuses what is not a finished eval run
        predictions += read_jsonl(run / "predictions.jsonl")
    sides = []
    for side in (first, second):
        method, _, budget = side.rpartition("@")
        try:
            sides.append((method, float(budget)))
        except ValueError:
            raise ValueError(f"{side!r}: expected METHOD@BUDGET, e.g. kvzip+am_fit@int4@0.03125") from None
    interval, tasks = headline_difference(predictions, sides[0], sides[1])
    return (
        f"{first} − {second}: {100 * interval.value:+.1f} points "
        f"[{100 * interval.low:+.1f}, {100 * interval.high:+.1f}] (paired 95%; {', '.join(tasks)})"
    )


TABLES = {"retention": retention_table, "cost": cost_table, "memory": memory_table}
"""The table kinds a page can ask for, by the name in its mark."""


def render(page_text: str, data: Path = DATA) -> str:
    """The page with every marked table generated again from its summary.

    Raises:
        ValueError: an unknown table kind, or a summary that is missing.
    """

    def table(match: re.Match) -> str:
        name, kind = match["name"], match["kind"]
        if kind not in TABLES:
            raise ValueError(f"table {name}: unknown kind {kind!r}; kinds: {', '.join(TABLES)}")
        path = data / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"table {name}: no summary {path}; make it with: summarize {name} RUN_DIR...")
        summary = json.loads(path.read_text(encoding="utf-8"))
        return f"<!-- table: {name} {kind} -->\n{TABLES[kind](summary)}\n<!-- /table -->"

    return MARK.sub(table, page_text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/current_results.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("summarize", help="write DATA/NAME.json from finished runs")
    p.add_argument("name", help="the summary's name (the page's marks use it)")
    p.add_argument("runs", nargs="+", type=Path, help="kvfold eval run directories, or kvfold bench directories")
    p.add_argument("--command", default=None, help="the command that made the runs, kept in the summary")
    p.add_argument("--data", type=Path, default=DATA, help="where summaries are kept")
    p = sub.add_parser("render", help="generate the marked tables of a page again")
    p.add_argument("page", type=Path, help="a Markdown page with <!-- table: NAME KIND --> marks")
    p.add_argument("--data", type=Path, default=DATA, help="where summaries are kept")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page is out of date")
    p = sub.add_parser("difference", help="headline retention of one method minus another's, paired interval")
    p.add_argument("runs", nargs="+", type=Path, help="kvfold eval run directories (one configuration)")
    p.add_argument("--first", required=True, help="METHOD@BUDGET, e.g. kvzip+am_fit@int4@0.03125")
    p.add_argument("--second", required=True, help="METHOD@BUDGET")
    args = parser.parse_args(argv)
    try:
        if args.action == "difference":
            print(difference(args.runs, args.first, args.second))
            return 0
        if args.action == "summarize":
            args.data.mkdir(parents=True, exist_ok=True)
            out = args.data / f"{args.name}.json"
            out.write_text(json.dumps(summarize(args.runs, args.command), indent=1) + "\n", encoding="utf-8")
            print(f"wrote {out}", file=sys.stderr)
            return 0
        text = args.page.read_text(encoding="utf-8")
        new = render(text, args.data)
        if args.check:
            if new != text:
                print(f"{args.page} is out of date: run tools/current_results.py render {args.page}", file=sys.stderr)
                return 1
            return 0
        args.page.write_text(new, encoding="utf-8")
        print(f"rendered {len(MARK.findall(new))} tables into {args.page}", file=sys.stderr)
        return 0
    except (ValueError, OSError) as err:
        print(f"tools/current_results.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
