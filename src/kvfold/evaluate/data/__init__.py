"""Evaluation data: the synthetic RULER generator (its word lists and prose as package data),
dataset loaders, samples."""
