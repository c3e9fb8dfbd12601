"""Scoring: task metrics and statistics (retention, intervals)."""
