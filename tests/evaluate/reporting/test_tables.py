"""The Markdown table builder and the labels of every report."""

from __future__ import annotations

import math

from kvfold.evaluate.reporting import markdown_table
from kvfold.evaluate.reporting.tables import budget_label, format_interval, format_number, table_budgets


def test_a_table_puts_names_left_and_numbers_right_by_default() -> None:
    table = markdown_table(["method", "0.5", "0.2"], [["`full`", "70.0", "70.0"], ["`snapkv`", "50.0", "–"]])
    assert table.splitlines() == [
        "| method | 0.5 | 0.2 |",
        "|:---|---:|---:|",
        "| `full` | 70.0 | 70.0 |",
        "| `snapkv` | 50.0 | – |",
    ]


def test_alignment_for_every_column_or_one_per_column() -> None:
    assert markdown_table(["a", "b", "c"], [], align="none").splitlines()[1] == "|---|---|---|"
    assert markdown_table(["a", "b", "c"], [], align=["right", "left"]).splitlines()[1] == "|---:|:---|:---|"
    assert markdown_table(["a"], [["x"]]) == "| a |\n|:---|\n| x |"


def test_numbers_intervals_and_budgets_as_text() -> None:
    assert format_number(None) == format_number(math.nan) == "–" and format_number(0.125, 2) == "0.12"
    assert format_interval(0.5, [0.25, 0.75], 100, 1) == "50.0 [25.0, 75.0]"
    assert format_interval(0.5, [math.nan, 0.75], 100, 1) == "50.0"  # an interval known at one end is not shown
    assert [budget_label(b) for b in table_budgets([0.2, 256, 0.5])] == ["256 tok", "0.5", "0.2"]
    assert table_budgets([]) == [1.0]
