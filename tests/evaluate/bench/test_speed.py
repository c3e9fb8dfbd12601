"""``kvfold bench`` end to end on a tiny local model (one process per configuration); its command line's
checks: tests/cli/test_bench.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from kvfold.cli.main import main
from kvfold.evaluate.bench.speed import bench, repeat_pass_scores
from kvfold.methods import build_method
from kvfold.runtime.attention import log_sum_exp_path

FIELDS = {
    "method",
    "budget",
    "length",
    "batch",
    "prefill_s",
    "compress_s",
    "decode_tokens_per_s",
    "peak_rss_mb",
    "kv_bytes",
    "kv_bytes_full",
    "limit_speedup",
    "reference_length",
    "reference_tokens_per_s",
}


@pytest.fixture(scope="module")
def serial_bench(tiny_dir, tmp_path_factory):
    """A serial bench of two (length, batch) items: full and streamingllm at 64 tokens, batch 1 and 2."""
    out = tmp_path_factory.mktemp("serial-bench")
    return bench(str(tiny_dir), ["streamingllm"], [0.25], [64], [1, 2], new_tokens=3, out_dir=out, progress=False), out


def test_bench_records_ratios_and_files(serial_bench):
    result, tmp_path = serial_bench
    records = result["records"]
    assert {(r["method"], r["batch"]) for r in records} == {
        ("full", 1),
        ("full", 2),
        ("streamingllm", 1),
        ("streamingllm", 2),
    }
    for record in records:
        assert set(record) >= FIELDS
        assert record["decode_tokens_per_s"] > 0 and record["peak_rss_mb"] > 0
    small = [r for r in records if r["method"] == "streamingllm"]
    assert all(r["kv_bytes"] <= 0.26 * r["kv_bytes_full"] for r in small)
    for record in small:  # the reference (full at the compressed size) decoded in the method's process
        full = next(r for r in records if r["method"] == "full" and r["batch"] == record["batch"])
        assert record["reference_length"] == 16
        assert record["limit_speedup"] == pytest.approx(record["reference_tokens_per_s"] / full["decode_tokens_per_s"])
        assert record["speedup_over_limit"] == pytest.approx(
            record["decode_tokens_per_s"] / record["reference_tokens_per_s"]
        )
    assert json.loads((tmp_path / "bench.json").read_text())["records"]
    assert "| streamingllm | 0.25 | 64 |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_resumes_from_finished_records(tiny_dir, tmp_path, monkeypatch):
    import kvfold.evaluate.bench.speed as bench_module

    first = bench(str(tiny_dir), ["streamingllm"], [0.25], [64], [1], new_tokens=2, out_dir=tmp_path, progress=False)
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 2  # full@64, streamingllm

    spawned = []
    real_spawn = bench_module._spawn
    monkeypatch.setattr(bench_module, "_spawn", lambda config, **kw: spawned.append(config) or real_spawn(config, **kw))
    again = bench(
        str(tiny_dir), ["streamingllm", "h2o"], [0.25], [64], [1], new_tokens=2, out_dir=tmp_path, progress=False
    )
    assert [c.method for c in spawned] == ["h2o"]  # only the configuration not measured before
    by_method = {r["method"]: r for r in again["records"]}
    old = {r["method"]: r for r in first["records"]}
    assert by_method["streamingllm"]["decode_tokens_per_s"] == old["streamingllm"]["decode_tokens_per_s"]

    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    older = [json.loads(line) for line in lines]
    for record in older:  # records of an older kvfold (no paired reference) are measured again
        record.pop("reference_tokens_per_s", None)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in older))
    spawned.clear()
    bench(str(tiny_dir), ["streamingllm"], [0.25], [64], [1], new_tokens=2, out_dir=tmp_path, progress=False)
    assert sorted(c.method for c in spawned) == ["full", "streamingllm"]

    (tmp_path / "records.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not a bench record"):
        bench(str(tiny_dir), ["streamingllm"], [0.25], [64], [1], new_tokens=2, out_dir=tmp_path, progress=False)


TIMED = {
    "prefill_s",
    "compress_s",
    "decode_tokens_per_s",
    "reference_tokens_per_s",
    "peak_rss_mb",
    "base_rss_mb",
    "speedup",
    "limit_speedup",
    "speedup_over_limit",
    "repeat_s",
    "compress_over_prefill",
    "compress_over_repeat",
    "compress_peak_mb",
    "compress_peak_over_cache",
}
"""Record fields that are measured (time or memory): they differ between any two runs."""


def _untimed(result: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in result["records"]]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed: pip install 'kvfold[ray]'")
def test_bench_on_ray_matches_serial_with_each_length_on_one_worker(tiny_dir, serial_bench, tmp_path, capsys):
    """``kvfold bench --ray`` (a local instance it starts and stops): the serial records (timings
    aside) in the same order, each (length, batch) measured by one worker, ratios within it."""
    import ray

    serial, _ = serial_bench
    out = tmp_path / "ray"
    args = ["bench", "--model", str(tiny_dir), "--methods", "streamingllm", "--budgets", "0.25", "--length", "64"]
    args += ["--batch", "1,2", "--new-tokens", "3", "--out", str(out), "--ray", "--ray-workers", "2"]
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "Ray workers started: 2;" in err and not ray.is_initialized()
    result = json.loads((out / "bench.json").read_text())
    assert _untimed(result) == _untimed(serial)
    assert [set(r) for r in result["records"]] == [set(r) for r in serial["records"]]
    workers = result["ray_workers"]
    assert len(workers) == 4 and all(int(w.rsplit(":", 1)[1]) != os.getpid() for w in workers.values())
    for batch in (1, 2):  # full and the method of one (length, batch) on the same worker
        assert workers[f"full @ 1.0, 64 tokens x {batch}"] == workers[f"streamingllm @ 0.25, 64 tokens x {batch}"]
    for record in result["records"]:
        full = next(r for r in result["records"] if r["method"] == "full" and r["batch"] == record["batch"])
        assert record["speedup"] == pytest.approx(record["decode_tokens_per_s"] / full["decode_tokens_per_s"])
    assert "Measured on Ray workers" in (out / "bench.md").read_text()


@pytest.mark.parametrize(
    ("method", "scored"),
    [
        ("kvzip", True),
        ("kvzip[plus=true]", True),
        ("kvzip+am_fit", True),
        ("am_highest", False),
        ("streamingllm", False),
    ],
)
def test_the_record_of_how_kvzips_scores_were_formed_is_for_methods_whose_pass_scores(method, scored):
    """``repeat_scores`` for a pass that scored the entries (any KVzip), not one that only kept queries."""
    assert repeat_pass_scores(build_method(method), 1.0) is scored
    assert repeat_pass_scores(build_method(method), None) is False  # no repeat pass timed


def test_bench_times_the_repeat_pass_for_methods_that_run_it(tiny_dir, tmp_path):
    result = bench(
        str(tiny_dir), ["kvzip", "kvzip+am_fit", "streamingllm"], [0.25], [64], [1], new_tokens=2, out_dir=tmp_path,
        progress=False,
    )  # fmt: skip
    by_method = {r["method"]: r for r in result["records"]}
    kvzip, streaming, full = by_method["kvzip"], by_method["streamingllm"], by_method["full"]
    assert by_method["kvzip+am_fit"]["fit_products"] == "float32 products (torch.float32 operands)"
    assert kvzip["fit_products"] is None and streaming["fit_products"] is None  # nothing fitted
    assert kvzip["repeat_s"] > 0
    assert kvzip["compress_over_repeat"] == pytest.approx(kvzip["compress_s"] / kvzip["repeat_s"])
    assert kvzip["compress_over_prefill"] == pytest.approx(kvzip["compress_s"] / kvzip["prefill_s"])
    assert streaming["repeat_s"] is None and streaming["compress_over_repeat"] is None  # no repeat pass
    assert kvzip["repeat_attention"] == log_sum_exp_path(torch.device("cpu"), torch.float32)
    assert streaming["repeat_attention"] is None
    assert kvzip["repeat_scores"] == "float32 products (on cpu)" and streaming["repeat_scores"] is None
    assert streaming["compress_over_prefill"] == pytest.approx(streaming["compress_s"] / streaming["prefill_s"])
    assert full["compress_over_repeat"] is None
    table = (tmp_path / "bench.md").read_text()
    assert "| c/prefill | c/repeat |" in table
    row = next(line for line in table.splitlines() if line.startswith("| kvzip |"))
    ratios = f"{kvzip['compress_over_prefill']:.2f} | {kvzip['compress_over_repeat']:.2f}"
    assert f"| {kvzip['repeat_s']:.2f} | {ratios} |" in row
    for record in (kvzip, streaming):  # the compression's own peak over the prefilled process
        assert record["compress_peak_mb"] >= 0
        assert record["compress_peak_over_cache"] == pytest.approx(
            record["compress_peak_mb"] * 2**20 / record["kv_bytes_full"]
        )
        assert row.endswith(f"| {kvzip['compress_peak_over_cache']:.2f} |")
    assert "| c peak/cache |" in table and (tmp_path / "scaling.png").stat().st_size > 0


def test_the_bench_compresses_under_the_prefills_plan():
    """The bench's in-place compression reads the repeat pass its prefill planned: ``kvzip`` measured
    alone records KVzip's scores and keeps no queries (their bytes would count in its peak)."""
    import torch

    import kvfold
    from kvfold.evaluate.bench.speed import _compress_in_place
    from kvfold.methods import build_method
    from kvfold.methods.core.repeat import REPEAT_CHUNK
    from kvfold.pipeline.context import prefill_ids
    from tests.conftest import CharTokenizer, make_tiny_model

    model, tok = kvfold.enable(make_tiny_model("llama")), CharTokenizer()
    ids = torch.tensor([tok("the quick brown fox jumps over the lazy dog " * 2).input_ids])
    method = build_method("kvzip")
    source = prefill_ids(model, tok, ids, capture_window=64, methods=[method])
    _compress_in_place(source, method, 0.25)
    found = source.shared[("repeat_pass", REPEAT_CHUNK)][0]
    assert found.recorded == {"scores"} and not found.queries


@pytest.mark.parametrize(
    ("spec", "uses"),
    [
        ("kvzip", True),
        ("kvzip+am_fit", True),
        ("am_highest_fast", True),
        ("am_highest[queries=selfstudy]", False),
        ("snapkv+am_fit", False),  # am_fit after a query-aware selector fits on the prefill's queries
        ("streamingllm", False),
    ],
)
def test_methods_say_whether_they_run_the_repeat_pass(spec, uses):
    from kvfold.methods import build_method

    assert build_method(spec).uses_repeat_pass is uses


@pytest.mark.parametrize(
    ("spec", "fits"),
    [
        ("kvzip+am_fit", True),
        ("snapkv+am_fit", True),
        ("am_highest_fast", True),
        ("am_omp", True),
        ("kvzip", False),
        ("kvzip+keepkv", False),
        ("streamingllm", False),
    ],
)
def test_methods_say_whether_they_fit_by_attention_matching(spec, fits):
    """``fit_products`` is recorded for these: Attention Matching's fits, alone or after a selector."""
    assert build_method(spec).fits_by_attention_matching is fits


def test_bench_chunked_prefill_runs(tiny_dir, tmp_path):
    result = bench(
        str(tiny_dir), ["streamingllm"], [16], [64], [1], new_tokens=2, prefill_chunk=16, out_dir=None, progress=False
    )
    record = next(r for r in result["records"] if r["method"] == "streamingllm")
    assert record["physical_tokens"] <= 16


def test_mmap_threshold_is_set_where_the_c_library_is_glibc():
    from kvfold.evaluate.bench import process as bench_common
    from kvfold.evaluate.bench import speed as bench_module

    expected = bench_common._glibc() is not None
    assert bench_module.set_mmap_threshold(bench_module.MEASURED_MMAP_THRESHOLD) is expected
    assert bench_module.set_mmap_threshold(bench_module.DECODE_MMAP_THRESHOLD) is expected


def test_a_chunked_sweep_measures_every_configuration_with_a_fixed_mmap_threshold():
    from kvfold.evaluate.bench.speed import plan

    runs, refs = plan("m", ["snapkv"], [0.1], [64, 128], [1], 4, prefill_chunk=32)
    assert runs and refs and all(c.bounded_memory for c in runs + refs)  # `full` included
    assert all(c.prefill_chunk is None for c in refs)
    runs, refs = plan("m", ["snapkv"], [0.1], [64], [1], 4, prefill_chunk=None)
    assert not any(c.bounded_memory for c in runs + refs)


def test_bench_measures_past_the_window_with_more_positions(tiny_dir, tmp_path):
    """``--positions``: a length past the model's window is refused without it, measured with it
    (the record keeps the positions), and fewer positions than the model's are refused."""
    from kvfold.cli.main import main

    with pytest.raises(ValueError, match="supports 512 positions"):
        bench(str(tiny_dir), ["kvzip"], [0.25], [600], [1], new_tokens=2, out_dir=tmp_path / "a", progress=False)
    grid = (str(tiny_dir), ["kvzip"], [0.25], [600], [1])
    result = bench(*grid, new_tokens=2, out_dir=tmp_path / "b", progress=False, positions=1024)
    assert {r["positions"] for r in result["records"]} == {1024} and all(r["length"] == 600 for r in result["records"])
    assert main(["bench", "--model", str(tiny_dir), "--methods", "kvzip", "--length", "64", "--batch", "1",
                 "--positions", "8", "--out", str(tmp_path / "c")]) == 2  # fmt: skip


def test_bench_measures_stock_transformers_beside_kvfolds_full_cache(tiny_dir, tmp_path, monkeypatch):
    """``stock`` (DynamicCache, SDPA) at each length, without a budget, decoded step for step with
    kvfold's full cache of the same context in its own process: ``speedup_over_limit`` is stock over
    kvfold, paired. ``stock-static`` (StaticCache, the forward compiled) measured the same way in this
    process with the compiler left out (compiling takes minutes here; ``benchmarks/gpu.sh`` runs it)."""
    import torch

    from kvfold.evaluate.bench.records import BenchConfig
    from kvfold.evaluate.bench.speed import run_stock

    result = bench(str(tiny_dir), ["stock"], [0.25, 0.5], [64], [1], new_tokens=3, out_dir=tmp_path, progress=False)
    by_method = {r["method"]: r for r in result["records"]}
    assert set(by_method) == {"full", "stock"} and len(result["records"]) == 2
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    static = run_stock(BenchConfig(str(tiny_dir), "stock-static", 1.0, 64, 1, new_tokens=3))
    for record in (by_method["stock"], static):
        assert record["budget"] == 1.0 and record["reference_length"] == 64 and record["stock"]
        assert record["decode_tokens_per_s"] > 0 and record["reference_tokens_per_s"] > 0
        assert record["kv_bytes"] == by_method["full"]["kv_bytes"]
    stock = by_method["stock"]
    assert stock["speedup_over_limit"] == pytest.approx(stock["decode_tokens_per_s"] / stock["reference_tokens_per_s"])
    assert "| stock | 1.0 | 64 |" in (tmp_path / "bench.md").read_text()


def test_the_path_a_decode_takes_is_recorded():
    """On a GPU: the Triton kernel for the formats it reads, PyTorch (and why) for the others; on the CPU:
    the C kernel's status; nothing for a cache held unquantized."""
    import torch

    from kvfold.evaluate.bench.speed import quantized_attention_path
    from kvfold.runtime import triton_attention
    from tests.pipeline.test_compiled_decode import _cache

    cuda = torch.device("cuda")
    assert quantized_attention_path(_cache("rows")[1], cuda) is None
    if triton_attention.available():
        assert quantized_attention_path(_cache("int4")[1], cuda) == "triton"
        assert quantized_attention_path(_cache("fp8")[1], cuda).startswith("torch (the Triton kernel does not read")
    assert quantized_attention_path(_cache("int4")[1], torch.device("cpu")).startswith(("native", "torch"))
    assert quantized_attention_path(_cache("int4")[1], torch.device("cpu"), compiled=True).startswith("torch (compiled")


def test_the_path_that_reads_stored_rows_is_recorded_whatever_their_format():
    """``stored_attention``: rows at full precision too (``kvzip`` at 0.1 holds them), on a GPU with the
    kernel's splits; nothing for the full cache."""
    import torch

    from kvfold.evaluate.bench.speed import quantized_attention_path, stored_attention_path
    from kvfold.runtime import triton_attention
    from tests.pipeline.test_compiled_decode import _cache

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert stored_attention_path(_cache("full")[1], cuda) is None
    assert stored_attention_path(_cache("rows")[1], cpu) == "torch"
    int4 = _cache("int4")[1]
    assert stored_attention_path(int4, cpu) == quantized_attention_path(int4, cpu)
    if triton_attention.available():
        rows = _cache("rows")[1]
        stored = [layer.stored for _, layer in rows.folded_layers]
        programs = sorted(s.pages.splits.count for s in stored)[len(stored) // 2]
        pages = max(s.pages.splits.per_split for s in stored)
        assert stored_attention_path(rows, cuda) == f"triton ({programs} programs a layer, at most {pages} pages each)"
        assert stored_attention_path(int4, cuda).startswith("triton (")
        assert stored_attention_path(_cache("fp8")[1], cuda).startswith("torch (the Triton kernel does not read")
