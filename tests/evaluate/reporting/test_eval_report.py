"""The eval report: its Markdown tables and valid PNG plots from result records."""

from __future__ import annotations

from pathlib import Path

from kvfold.evaluate.reporting import eval_markdown, write_eval_report
from tests.evaluate.reporting.conftest import assert_png, records_of


def test_eval_markdown_tables() -> None:
    text = eval_markdown(records_of(), {"model": "tiny", "dataset": "ruler"})
    assert "**model**: tiny" in text
    assert "## Average score by budget" in text
    assert "| method | 0.5 | 0.2 |" in text  # mildest compression first
    assert "## Budget 0.2: score by task" in text and "## Budget 0.5: score by task" in text
    assert "| method | niah_single_1 | vt | **average** |" in text
    assert "| `full` (1.0) | 100.0 | 40.0 | **70.0** |" in text
    assert "| `streamingllm` | 20.0 | 8.0 | **14.0** |" in text
    assert "| `streamingllm[sinks=8]` | 0.250 | 0.250 |" in text  # KV ratio table


def test_retention_ranking_leaves_out_what_the_full_cache_fails() -> None:
    text = eval_markdown(records_of(), {"model": "tiny"})
    # full: niah_single_1 100, vt 40 -> vt is reported apart; retention = score / 100 on niah_single_1
    assert "tasks the full cache solves (≥ 50): niah_single_1." in text
    assert "Reported apart (full cache below 50): vt." in text
    section = text.split("### Budget 0.5")[1].split("##")[0]
    # one context per task: a bootstrap over contexts cannot show spread, so no interval is printed
    assert "| 1 | `streamingllm` | 50.0 | 50.0 |" in section


def test_write_eval_report_writes_valid_pngs(tmp_path: Path) -> None:
    paths = write_eval_report(tmp_path, records_of(), {"model": "tiny"})
    names = ["report.md", "retention.png", "retention_time.png", "scores.png", "scores_by_task.png"]
    assert [p.name for p in paths] == names
    for path in paths[1:]:
        assert_png(path)
    assert "![average score vs budget](scores.png)" in paths[0].read_text()


def test_token_budgets_and_a_single_budget(tmp_path: Path) -> None:
    for name, budgets in (("tokens", (256, 0.5)), ("single", (0.2,))):
        out = tmp_path / name
        out.mkdir()
        paths = write_eval_report(out, records_of(budgets))
        assert_png(paths[1])
    assert "256 tok" in (tmp_path / "tokens" / "report.md").read_text()
