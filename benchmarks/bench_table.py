"""The table of ``kvfold bench`` folders from their records, finished or not.

Usage::

    python benchmarks/bench_table.py DIR [DIR ...]

Reads each folder's ``records.jsonl`` (every configuration measured so far, also by several
invocations on one folder, or by one cut short) and prints the bench's Markdown table, the ratios
against ``full`` at the same length and batch computed as ``kvfold bench`` computes them; a
configuration whose ``full`` is missing is left out, said on stderr. Under each table, the paths each
method's run took where a record says (``stored_attention``, ``repeat_attention``, ``repeat_scores``,
``fit_products``: docs/benchmarks.md). ``benchmarks/gpu.sh`` writes its ``README.md`` with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfold.evaluate.bench.records import RECORDS_FILE, compression_ratios
from kvfold.evaluate.bench.report import bench_markdown
from kvfold.runtime.files import read_jsonl


def with_ratios(records: list[dict]) -> list[dict]:
    """``records`` with ``speedup``, ``limit_speedup``, ``speedup_over_limit`` and the compression
    ratios, against the ``full`` record of the same model, length and batch (those without one dropped)."""
    full = {(r["model"], r["length"], r["batch"]): r for r in records if r["method"] == "full"}
    out = []
    for record in records:
        reference = full.get((record["model"], record["length"], record["batch"]))
        if reference is None:
            where = f"{record['length']} x {record['batch']}"
            print(f"no full record at {where}: {record['method']} left out", file=sys.stderr)
            continue
        speed, ref_speed = record["decode_tokens_per_s"], record["reference_tokens_per_s"]
        record = {**record, **compression_ratios(record)}
        record["speedup"] = speed / reference["decode_tokens_per_s"]
        record["limit_speedup"] = ref_speed / reference["decode_tokens_per_s"]
        record["speedup_over_limit"] = speed / ref_speed
        out.append(record)
    return out


PATHS = {
    "stored_attention": "stored rows",
    "repeat_attention": "repeat pass's attention",
    "repeat_scores": "KVzip's scores",
    "fit_products": "fits' logits",
}
"""The records' path fields, and how the list under a table names them."""


def path_lines(records: list[dict]) -> list[str]:
    """One line a method whose records say which paths its run took (the first record's; those without any
    left out): ``- kvzip: stored rows: triton (...); KVzip's scores: fused (Triton)``."""
    lines, seen = [], set()
    for record in records:
        said = [f"{name}: {record[field]}" for field, name in PATHS.items() if record.get(field)]
        if said and record["method"] not in seen:
            seen.add(record["method"])
            lines.append(f"- {record['method']}: " + "; ".join(said))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for folder in args.dirs:
        path = folder / RECORDS_FILE
        if not path.is_file():
            print(f"{folder}: no records", file=sys.stderr)
            continue
        records = with_ratios(list(read_jsonl(path, what="bench record")))
        model = records[0]["model"] if records else "?"
        print(bench_markdown({"model": f"{model} ({folder.name})", "records": records}))
        paths = path_lines(records)
        if paths:
            print("\nPaths taken:\n")
            print("\n".join(paths))


if __name__ == "__main__":
    main()
