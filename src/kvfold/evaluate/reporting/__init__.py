"""Reporting: Markdown tables, JSON and plots from result files.

:func:`markdown_table` builds every Markdown table of kvfold's reports; :func:`eval_markdown` and
:func:`fidelity_markdown` are the reports of ``kvfold eval`` and ``kvfold fidelity``, written with
their plots by :func:`write_eval_report` and :func:`write_fidelity_report`.
"""

from kvfold.evaluate.reporting.eval_report import eval_markdown, write_eval_report
from kvfold.evaluate.reporting.fidelity_report import fidelity_markdown, plot_fidelity, write_fidelity_report
from kvfold.evaluate.reporting.plots import plot_retention, plot_scores
from kvfold.evaluate.reporting.tables import markdown_table

__all__ = [
    "eval_markdown",
    "fidelity_markdown",
    "markdown_table",
    "plot_fidelity",
    "plot_retention",
    "plot_scores",
    "write_eval_report",
    "write_fidelity_report",
]
