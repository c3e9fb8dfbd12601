"""tools/current_results.py: result summaries kept in the repository, and the tables a page
generates from them."""

from __future__ import annotations

import json

import pytest

import kvfold
import kvfold.runtime.models
from kvfold.cli.main import main as kvfold_main
from tests.conftest import CharTokenizer, make_tiny_model
from tests.tools.scripts import ROOT, load_script

tool = load_script("tools/current_results.py")


def _headline(method: str, budget: float, retention: float) -> dict:
    return {"method": method, "budget": budget, "task": "headline", "score": 50.0,
            "retention": retention, "retention_ci": [retention - 0.1, retention + 0.05]}  # fmt: skip


def _bench(method: str, length: int, compress_s: float) -> dict:
    return {"method": method, "budget": 0.1 if method != "full" else 1.0, "length": length, "batch": 1,
            "prefill_s": 2.0, "compress_s": compress_s, "compress_peak_over_cache": 0.5, "speedup": 1.5,
            "kv_bytes": 2**20, "kv_bytes_full": 10 * 2**20, "new_tokens": 4, "prefill_chunk": None,
            "model": "m", "dtype": "auto", "device": "auto"}  # fmt: skip


PAGE = """# Current numbers

Which pipeline:

<!-- table: suite retention -->
stale
<!-- /table -->

What it costs:

<!-- table: speed cost -->
<!-- /table -->
"""


def test_a_page_is_rendered_from_its_summaries_and_checked(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    records = [
        _headline("kvzip", 0.1, 0.84),
        _headline("kvzip+am_fit", 0.1, 0.905),
        _headline("kvzip+am_fit", 0.05, 0.8),
    ]
    (data / "suite.json").write_text(json.dumps({"kind": "eval", "config": {}, "records": records}))
    (data / "speed.json").write_text(json.dumps({"kind": "bench", "records": [_bench("full", 2048, 0.0),
                                                                             _bench("kvzip", 2048, 3.3)]}))  # fmt: skip
    page = tmp_path / "current.md"
    page.write_text(PAGE)
    assert tool.main(["render", str(page), "--data", str(data), "--check"]) == 1  # stale
    assert tool.main(["render", str(page), "--data", str(data)]) == 0
    text = page.read_text()
    assert "stale" not in text and text.startswith(
        "# Current numbers\n\nWhich pipeline:\n\n<!-- table: suite retention"
    )
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows[0] == "| `kvzip+am_fit` | 90.5 [80.5, 95.5] | 80.0 [70.0, 85.0] |"  # best first, both budgets
    assert rows[1] == "| `kvzip` | 84.0 [74.0, 89.0] | — |"  # not run at 0.05
    assert "| method | keep 0.1 | keep 0.05 |" in text
    assert rows[3].startswith(
        "| `kvzip` | 0.1 | 2,048 | 1 | 1.65× | 0.50× | 1.50× | — | 1.0 | 0.1000 | 16 |"
    )  # 3.3 s / 2.0 s
    assert tool.main(["render", str(page), "--data", str(data), "--check"]) == 0  # up to date
    page.write_text(PAGE.replace("speed cost", "speed plot"))
    capsys.readouterr()
    assert tool.main(["render", str(page), "--data", str(data)]) == 2
    assert "unknown kind 'plot'" in capsys.readouterr().err
    page.write_text(PAGE.replace("suite retention", "nothing retention"))
    assert tool.main(["render", str(page), "--data", str(data)]) == 2
    assert "no summary" in capsys.readouterr().err


def test_bench_directories_are_summarized_merged(tmp_path):
    for name, method in (("a", "kvzip"), ("b", "snapkv")):
        (tmp_path / name).mkdir()
        result = {"model": "m", "records": [_bench("full", 2048, 0.0), _bench(method, 2048, 1.0)]}
        (tmp_path / name / "bench.json").write_text(json.dumps(result))
    assert tool.main(["summarize", "speed", str(tmp_path / "a"), str(tmp_path / "b"), "--command", "kvfold bench",
                      "--data", str(tmp_path / "data")]) == 0  # fmt: skip
    summary = json.loads((tmp_path / "data" / "speed.json").read_text())
    assert summary["kind"] == "bench" and summary["command"] == "kvfold bench"
    assert [r["method"] for r in summary["records"]] == ["full", "kvzip", "snapkv"]  # full once
    assert summary["sources"] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_eval_runs_are_summarized_to_their_headline_and_average_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        kvfold.runtime.models, "load_model", lambda spec, **kw: (kvfold.enable(make_tiny_model()), CharTokenizer())
    )
    data = tmp_path / "mini.jsonl"
    rows = [{"context": "The fox jumps. " * 3, "question": "\nWhat jumps?", "answers": ["fox"], "task": "animals",
             "max_new_tokens": 2}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "--dataset", str(data), "--methods", "full,streamingllm", "--budgets", "0.5", "--quiet"]
    assert kvfold_main([*args, "--out", str(tmp_path / "run")]) == 0
    assert tool.main(["summarize", "mini", str(tmp_path / "run"), "--data", str(tmp_path / "data")]) == 0
    summary = json.loads((tmp_path / "data" / "mini.json").read_text())
    results = json.loads((tmp_path / "run" / "results.json").read_text())["records"]
    assert summary["kind"] == "eval" and summary["config"]["dataset"] == str(data)
    assert summary["records"] == [r for r in results if r["task"] in tool.EVAL_TASKS] and summary["records"]
    assert len(summary["records"]) < len(results)  # the per-task records stay in the run
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench.json").write_text(json.dumps({"model": "m", "records": []}))
    capsys.readouterr()
    assert tool.main(["summarize", "x", str(tmp_path / "run"), str(tmp_path / "bench")]) == 2
    assert "apart" in capsys.readouterr().err
    # the paired difference of two (method, budget)s of the run (computed in test_records); its errors
    run = str(tmp_path / "run")
    assert tool.main(["difference", run, "--first", "streamingllm@0.25", "--second", "streamingllm@0.5"]) == 2
    assert "no query-agnostic predictions of streamingllm at 0.25" in capsys.readouterr().err
    assert tool.main(["difference", run, "--first", "streamingllm", "--second", "streamingllm@0.5"]) == 2
    assert "expected METHOD@BUDGET" in capsys.readouterr().err
    results_full = [r for r in results if r["method"] == "full" and r["task"] == "animals"]
    if results_full[0]["score"] < 50:  # the tiny model's full cache: no headline task to compare on
        assert tool.main(["difference", run, "--first", "streamingllm@0.5", "--second", "streamingllm@0.5"]) == 2
        assert "no headline task" in capsys.readouterr().err


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "results").glob("*.md")))
def test_the_repository_pages_are_what_their_summaries_render(page):
    """A page with marked tables is up to date with docs/results/data (pages without marks pass)."""
    assert tool.main(["render", str(page), "--check"]) == 0
