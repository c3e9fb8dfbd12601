"""Reports: Markdown tables and valid PNG plots from result records."""

from __future__ import annotations

from pathlib import Path

from kvfold.evaluate.reporting.report import eval_markdown, fidelity_markdown, write_eval_report, write_fidelity_report
from kvfold.evaluate.running.runner import aggregate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(budgets=(0.5, 0.2)) -> list[dict]:
    predictions = []
    for method, run_budgets in (("full", (1.0,)), ("streamingllm", budgets), ("streamingllm[sinks=8]", budgets)):
        for budget in run_budgets:
            for task, score in (("niah_single_1", 100.0), ("vt", 40.0)):
                predictions.append(
                    {
                        "method": method,
                        "budget": budget,
                        "task": task,
                        "sample_id": f"{task}/0",
                        "query_aware": False,
                        "score": score * (budget if isinstance(budget, float) else 0.5),
                        "kv_bytes": 10,
                        "kv_bytes_full": 40,
                    }
                )
    return aggregate(predictions)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_eval_markdown_tables() -> None:
    text = eval_markdown(_records(), {"model": "tiny", "dataset": "ruler"})
    assert "**model**: tiny" in text
    assert "## Average score by budget" in text
    assert "| method | 0.5 | 0.2 |" in text  # mildest compression first
    assert "## Budget 0.2: score by task" in text and "## Budget 0.5: score by task" in text
    assert "| method | niah_single_1 | vt | **average** |" in text
    assert "| `full` (1.0) | 100.0 | 40.0 | **70.0** |" in text
    assert "| `streamingllm` | 20.0 | 8.0 | **14.0** |" in text
    assert "| `streamingllm[sinks=8]` | 0.250 | 0.250 |" in text  # KV ratio table


def test_retention_ranking_leaves_out_what_the_full_cache_fails() -> None:
    text = eval_markdown(_records(), {"model": "tiny"})
    # full: niah_single_1 100, vt 40 -> vt is reported apart; retention = score / 100 on niah_single_1
    assert "tasks the full cache solves (≥ 50): niah_single_1." in text
    assert "Reported apart (full cache below 50): vt." in text
    section = text.split("### Budget 0.5")[1].split("##")[0]
    # one context per task: a bootstrap over contexts cannot show spread, so no interval is printed
    assert "| 1 | `streamingllm` | 50.0 | 50.0 |" in section


def test_write_eval_report_writes_valid_pngs(tmp_path: Path) -> None:
    paths = write_eval_report(tmp_path, _records(), {"model": "tiny"})
    names = ["report.md", "retention.png", "retention_time.png", "scores.png", "scores_by_task.png"]
    assert [p.name for p in paths] == names
    for path in paths[1:]:
        _assert_png(path)
    assert "![average score vs budget](scores.png)" in paths[0].read_text()


def test_token_budgets_and_a_single_budget(tmp_path: Path) -> None:
    for name, budgets in (("tokens", (256, 0.5)), ("single", (0.2,))):
        out = tmp_path / name
        out.mkdir()
        paths = write_eval_report(out, _records(budgets))
        _assert_png(paths[1])
    assert "256 tok" in (tmp_path / "tokens" / "report.md").read_text()


def test_fidelity_report(tmp_path: Path) -> None:
    records = [
        {
            "method": "full",
            "budget": 1.0,
            "rel_error": 0.0,
            "nll_delta": 0.0,
            "kl": 0.0,
            "kv_ratio": 1.0,
            "per_layer": [0.0, 0.0],
            "n": 2,
        },
        *(
            {
                "method": "streamingllm",
                "budget": b,
                "rel_error": 0.1 / b,
                "nll_delta": 0.01 / b,
                "kl": 0.001 / b,
                "kv_ratio": b,
                "per_layer": [0.05 / b, 0.15 / b],
                "n": 2,
            }
            for b in (0.5, 0.2, 0.1)
        ),
    ]
    text = fidelity_markdown(records)
    assert "| method | 0.5 | 0.2 | 0.1 |" in text
    assert "| `streamingllm` | 0.2 | 0.5 | 1 |" in text
    assert "| layer | `streamingllm` @ 0.5 | `streamingllm` @ 0.2 | `streamingllm` @ 0.1 |" in text
    paths = write_fidelity_report(tmp_path, records)
    _assert_png(paths[1])
