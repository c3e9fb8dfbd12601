"""Reporting: Markdown tables, JSON and plots from result files."""
