"""The report of ``kvfold bench`` (:mod:`kvfold.evaluate.bench.report`) from hand-made records; the files a
real bench writes: test_speed.py."""

from __future__ import annotations

import json

import pytest

from kvfold.evaluate.bench.report import (
    BENCH_FILE,
    bench_markdown,
    merge_bench_results,
    read_bench_run,
    write_bench_report,
)
from kvfold.runtime.errors import UserError


def _record(method: str, budget: float = 1.0, **fields) -> dict:
    """A finished record of ``method`` at 64 tokens, batch 1 (its ratios already computed)."""
    return {
        "model": "m",
        "method": method,
        "budget": budget,
        "length": 64,
        "batch": 1,
        "prefill_s": 2.0,
        "compress_s": 1.0,
        "decode_tokens_per_s": 50.0,
        "speedup": 1.25,
        "limit_speedup": 1.5,
        "speedup_over_limit": 0.8,
        "kv_bytes": 2**20,
        "kv_bytes_full": 4 * 2**20,
        "peak_rss_mb": 300.0,
        **fields,
    }


def test_a_bench_folder_is_read_back_or_refused_plainly(tmp_path):
    with pytest.raises(UserError, match=f"holds no {BENCH_FILE}"):
        read_bench_run(tmp_path)
    (tmp_path / BENCH_FILE).write_text("{not json")
    with pytest.raises(UserError, match="is not valid JSON"):
        read_bench_run(tmp_path)
    (tmp_path / BENCH_FILE).write_text(json.dumps({"model": "m"}))
    with pytest.raises(UserError, match="has no records"):
        read_bench_run(tmp_path)
    result = {"model": "m", "records": [_record("full")]}
    (tmp_path / BENCH_FILE).write_text(json.dumps(result))
    assert read_bench_run(str(tmp_path)) == result


def test_benches_of_one_model_merge_with_the_first_measure_of_a_configuration_kept():
    first = {"model": "m", "records": [_record("full"), _record("kvzip", 0.1)]}
    second = {"model": "m", "records": [_record("full", decode_tokens_per_s=1.0), _record("snapkv", 0.1)]}
    merged = merge_bench_results([first, second])
    assert merged["model"] == "m"
    assert [(r["method"], r["decode_tokens_per_s"]) for r in merged["records"]] == [
        ("full", 50.0),
        ("kvzip", 50.0),
        ("snapkv", 50.0),
    ]
    with pytest.raises(UserError, match="different models"):
        merge_bench_results([first, {"model": "other", "records": []}])


def test_the_table_has_a_row_a_configuration_and_names_the_ray_workers():
    records = [
        _record("kvzip", 0.1, compiled=True, repeat_s=0.5, memory_ratio=0.125, kv_format="int4"),
        _record("stock", compiled=True),
        _record("full"),  # an older record: no memory_ratio, its ratio in the model's dtype
    ]
    page = bench_markdown({"model": "m", "records": records, "ray_workers": {"full @ 1.0, 64 tokens x 1": "h:1"}})
    assert page.startswith("# kvfold bench — m\n")
    rows = [line for line in page.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| full", "| kvzip (compiled)", "| stock"]  # stock's own steps
    kvzip = rows[1]
    assert "| 0.50 | 0.50 | 2.00 |" in kvzip  # repeat s, compression over prefill and over the repeat pass
    assert "| 0.1250 | int4 |" in kvzip and rows[0].endswith("| 0.2500 | 16 | 300 | — |")
    assert "Measured on Ray workers" in page and "* full @ 1.0, 64 tokens x 1: `h:1`" in page


def test_the_report_files_and_the_scaling_plot_only_where_the_peak_was_measured(tmp_path):
    result = {"model": "m", "records": [_record("full"), _record("kvzip", 0.1)]}
    write_bench_report(result, tmp_path)
    assert json.loads((tmp_path / BENCH_FILE).read_text()) == result
    assert (tmp_path / "bench.md").read_text() == bench_markdown(result)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "scaling.png").exists()
    result["records"][1]["compress_peak_over_cache"] = 0.5
    write_bench_report(result, tmp_path)
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scaling_plot_with_nothing_compressed_says_so_without_a_warning(tmp_path):
    """Stock transformers and the full cache alone (a peak recorded, nothing compressed): the plot is
    drawn with a note instead of an empty legend (which matplotlib warns about)."""
    import warnings

    result = {"model": "m", "records": [_record("full", compress_peak_over_cache=0.0), _record("stock")]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_bench_report(result, tmp_path)
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
