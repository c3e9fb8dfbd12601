"""Scoring: task metrics, statistics (retention, intervals), and the result records made of them."""
