"""Evaluation: tasks, dataset loaders and metrics."""
