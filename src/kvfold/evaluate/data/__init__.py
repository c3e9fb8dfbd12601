"""Evaluation data: the synthetic RULER generator (its word lists and prose as package data),
dataset loaders (bring-your-own JSONL, LongBench, XSum, RULER's own files), samples."""
