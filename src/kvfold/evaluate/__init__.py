"""Evaluation: tasks, dataset loaders, metrics, quality sweeps and fidelity measurements.

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
from kvfold.evaluate.reporting.report import write_eval_report, write_fidelity_report
from kvfold.evaluate.running.fidelity import FidelityResult, fidelity
from kvfold.evaluate.running.runner import EvalResult, aggregate, evaluate
from kvfold.evaluate.scoring.metrics import METRICS, score, score_sample, score_sample_metrics

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
