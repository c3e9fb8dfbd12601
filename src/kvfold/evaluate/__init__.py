"""Evaluation: tasks, dataset loaders, metrics, quality sweeps and fidelity measurements.

By role: :mod:`~kvfold.evaluate.data` (the synthetic RULER suite, dataset loaders, samples),
:mod:`~kvfold.evaluate.running` (the quality and fidelity sweeps, Ray, finished runs read back),
:mod:`~kvfold.evaluate.scoring` (metrics, intervals, result records),
:mod:`~kvfold.evaluate.reporting` (Markdown tables and plots), :mod:`~kvfold.evaluate.diagnostics`
(what a merge did to the cache) and :mod:`~kvfold.evaluate.bench` (speed and memory).

Example:
    >>> from kvfold import load_model
    >>> from kvfold.evaluate import evaluate, fidelity, load_dataset_spec
    >>> model, tokenizer = load_model()
    >>> samples = load_dataset_spec("ruler", tokenizer, length=2048, samples=1)
    >>> evaluate(model, tokenizer, samples, ["full", "streamingllm"], [0.2], out_dir="runs/ruler")
    >>> fidelity(model, tokenizer, samples, ["full", "streamingllm"], [0.5, 0.2], out_dir="runs/fid")
"""

from kvfold.evaluate.data.loaders import load_dataset_spec, load_jsonl, load_longbench, load_ruler_official, load_xsum
from kvfold.evaluate.data.ruler import RULER_TASKS, generate_ruler
from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.evaluate.reporting import write_eval_report, write_fidelity_report
from kvfold.evaluate.running.fidelity import FidelityResult, fidelity
from kvfold.evaluate.running.runner import EvalResult, evaluate
from kvfold.evaluate.scoring.metrics import METRICS, score, score_sample, score_sample_metrics
from kvfold.evaluate.scoring.records import aggregate

__all__ = [
    "METRICS",
    "RULER_TASKS",
    "EvalResult",
    "FidelityResult",
    "Sample",
    "aggregate",
    "evaluate",
    "fidelity",
    "generate_ruler",
    "group_by_context",
    "load_dataset_spec",
    "load_jsonl",
    "load_longbench",
    "load_ruler_official",
    "load_xsum",
    "score",
    "score_sample",
    "score_sample_metrics",
    "write_eval_report",
    "write_fidelity_report",
]
