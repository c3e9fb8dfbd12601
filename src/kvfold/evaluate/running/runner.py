"""Quality sweeps: every sample × method × budget, prefilling each context once.

The protocol of docs/evaluation.md: by default **query-agnostic** — a context is
prefilled once, and for every (method, budget) a copy of its full cache is compressed and asked
every question about that context (each question decodes on its own copy). With
``query_aware=True`` each (context, question) pair is prefilled with the question inside the
compressed part. ``full`` runs once, at budget 1.0, whatever the budgets.

Files written to ``out_dir`` (all optional; the Python result holds the same data):

* ``run.json`` — the run's configuration (model, dataset, length, seed). A rerun into the same
  directory must match it.
* ``predictions.jsonl`` — one line per sample × method × budget, appended as it is produced.
  A rerun reads it and skips what is done (key: sample id, method, budget, query-aware), so an
  interrupted sweep resumes where it stopped.
* ``results.json`` — ``{"model", "records": [...]}``, one record per (method, budget, task) plus
  an ``"average"`` task (macro average over tasks) per (method, budget).
* ``report.md`` and PNG plots (see :mod:`kvfold.evaluate.reporting.eval_report`).

The sweep is cut into :class:`WorkItem` s, one per context, answered here (:func:`evaluate`) or by
Ray workers (:mod:`kvfold.evaluate.running.distributed`) through the same driver
(:meth:`EvalSweep.run`, :func:`kvfold.evaluate.running.sweep.collect_rows`), with the same rows in
the same order. Records are made by :func:`kvfold.evaluate.scoring.records.aggregate`.

Example:
    >>> from kvfold import load_model
    >>> from kvfold.evaluate import evaluate, generate_ruler
    >>> model, tokenizer = load_model()
    >>> samples = generate_ruler(tokenizer, 2048, 2)
    >>> result = evaluate(model, tokenizer, samples, ["full", "streamingllm"], [0.2], out_dir="runs/a")
    >>> result.score("streamingllm", 0.2)  # average over tasks, 0-100
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.evaluate.reporting.eval_report import write_eval_report
from kvfold.evaluate.running.sweep import (
    ItemRunner,
    collect_rows,
    is_full,
    local_runner,
    open_run,
    plan_runs,
    sample_keys,
    write_json,
)
from kvfold.evaluate.scoring.metrics import score_sample_metrics
from kvfold.evaluate.scoring.records import AVERAGE_TASK, aggregate
from kvfold.methods import build_method
from kvfold.methods.core.model import model_name
from kvfold.pipeline.context import CompressedContext, PrefilledContext, prefill
from kvfold.runtime.budget import Budget
from kvfold.runtime.errors import UserError

__all__ = [
    "PREDICTIONS_FILE",
    "RESULTS_FILE",
    "EvalResult",
    "EvalSweep",
    "WorkItem",
    "answer_context",
    "context_id",
    "evaluate",
    "plan_items",
    "row_key",
    "run_item",
    "unit_key",
]

PREDICTIONS_FILE = "predictions.jsonl"
RESULTS_FILE = "results.json"


@dataclass
class EvalResult:
    """What :func:`evaluate` produced.

    Attributes:
        model: the model's name (from the run configuration).
        records: one dict per (method, budget, task) with ``score`` (0-100), ``n``,
            ``query_aware``, ``kv_ratio`` and mean per-metric scores; ``task == "average"`` rows
            hold the macro average over tasks.
        predictions: one dict per sample × method × budget (reused ones included).
        out_dir: where the files were written, or None.
    """

    model: str
    records: list[dict[str, Any]]
    predictions: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None

    def score(self, method: str, budget: float | int | str = 1.0, task: str = AVERAGE_TASK) -> float:
        """The score of one (method, budget, task); ``full`` is looked up at budget 1.0.

        Raises:
            KeyError: no such record.
        """
        label = 1.0 if is_full(method) else Budget.parse(budget).label()
        for record in self.records:
            if record["method"] == method and record["budget"] == label and record["task"] == task:
                return record["score"]
        raise KeyError(f"no result for method {method!r}, budget {label}, task {task!r}")

    def to_json(self) -> dict[str, Any]:
        """The content of ``results.json``."""
        return {"model": self.model, "records": self.records}


def unit_key(sample_id: str, method: str, budget: float | int, query_aware: bool) -> tuple[str, str, str, bool]:
    """The key of one answer of a sweep: sample id, method spec, budget label (as JSON), query-awareness."""
    return sample_id, method, json.dumps(budget), bool(query_aware)


def row_key(row: Mapping[str, Any]) -> tuple[str, str, str, bool]:
    """The key that identifies a prediction row in a sweep: sample id, method, budget, query-awareness."""
    return unit_key(row["sample_id"], row["method"], row["budget"], row["query_aware"])


def _use_chat_template(sample: Sample) -> bool | None:
    """``None`` (the model's template when it has one) unless the sample asks for a raw prompt."""
    return None if sample.chat_template else False


def _question(sample: Sample) -> str:
    """The question as the pipeline appends it: :func:`build_prompt` adds its own separator."""
    return sample.question.lstrip()


@dataclass(frozen=True)
class WorkItem:
    """One context's share of a sweep: prefilled once, compressed once per (method, budget).

    The unit a sweep is cut into; :func:`run_item` answers it on any process that holds the
    model, so a sweep can run here (:func:`evaluate`) or on a cluster
    (:mod:`kvfold.evaluate.running.distributed`).

    Attributes:
        index: position of the item in the sweep (the serial order of its answers).
        samples: samples sharing one context and prompt format (one sample when query-aware).
        sample_ids: their ids (:func:`~kvfold.evaluate.running.sweep.sample_keys`).
        runs: ``(method spec, budget)`` pairs with at least one answer to produce.
        skip: unit keys already answered (earlier runs, or an earlier attempt of this item).
        query_aware: compress the context together with its question.
        seed: seed for randomized methods.
    """

    index: int
    samples: tuple[Sample, ...]
    sample_ids: tuple[str, ...]
    runs: tuple[tuple[str, Budget], ...]
    skip: frozenset[tuple[str, str, str, bool]] = frozenset()
    query_aware: bool = False
    seed: int = 0

    def unit_keys(self) -> list[tuple[str, str, str, bool]]:
        """The keys of the answers this item produces, in the order it produces them."""
        keys = [
            unit_key(sid, spec, budget.label(), self.query_aware)
            for spec, budget in self.runs
            for sid in self.sample_ids
        ]
        return [k for k in keys if k not in self.skip]

    @property
    def label(self) -> str:
        """What this item is, for messages."""
        return f"the context of {self.sample_ids[0]}"

    @staticmethod
    def row_key(row: Mapping[str, Any]) -> tuple[str, str, str, bool]:
        """The unit key of one of this item's rows (:func:`row_key`)."""
        return row_key(row)

    def run(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, status: Callable[[str], None] | None = None
    ) -> Iterator[dict[str, Any]]:
        """The item's prediction rows (:func:`run_item`); ``status`` hears each (method, budget)."""
        on_method = None if status is None else lambda spec, budget: status(f"{spec} @ {budget}")
        return run_item(model, tokenizer, self, on_method)


def run_item(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    item: WorkItem,
    on_method: Callable[[str, Budget], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The prediction rows of one work item (:func:`answer_context` on its samples)."""
    return answer_context(
        model,
        tokenizer,
        item.samples,
        item.sample_ids,
        item.runs,
        query_aware=item.query_aware,
        seed=item.seed,
        skip=item.skip,
        on_method=on_method,
    )


def plan_items(
    samples: Sequence[Sample],
    runs: Sequence[tuple[str, Budget]],
    done: Collection[tuple[str, str, str, bool]] = (),
    *,
    query_aware: bool = False,
    seed: int = 0,
) -> list[WorkItem]:
    """Cut a sweep into work items, leaving out answers already in ``done``.

    An item is one prefill group (:func:`answer_context`) with the runs that still miss an answer
    for one of its samples; a group whose answers are all in ``done`` gives no item.
    """
    key_of = {id(s): k for s, k in zip(samples, sample_keys(samples), strict=True)}
    items: list[WorkItem] = []
    for group in _prefill_groups(samples, query_aware):
        ids = tuple(key_of[id(s)] for s in group)
        pending = tuple(
            (spec, b) for spec, b in runs if any(unit_key(sid, spec, b.label(), query_aware) not in done for sid in ids)
        )
        if pending:
            skip = frozenset(k for k in done if k[0] in ids)
            items.append(WorkItem(len(items), tuple(group), ids, pending, skip, query_aware, seed))
    return items


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    methods: Sequence[str],
    budgets: Sequence[float | int | str | Budget],
    *,
    query_aware: bool = False,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    run_config: Mapping[str, Any] | None = None,
) -> EvalResult:
    """Answer every sample with every method and budget, and score the answers.

    Args:
        model: a model with the kvfold attention (:func:`kvfold.load_model` or :func:`kvfold.enable`).
        tokenizer: its tokenizer.
        samples: the samples (:func:`~kvfold.evaluate.load_dataset_spec`, ``generate_ruler``, ...).
        methods: method specs; each is reported exactly as written. ``full`` runs once at 1.0.
        budgets: fractions in (0, 1] or token counts.
        query_aware: compress each context together with its question.
        seed: seed for randomized methods.
        out_dir: where to write the files (see the module docstring); resumes a run found there.
        progress: show a progress bar over sample × method × budget units.
        run_config: what identifies the run for resuming (model, dataset, length, seed); by
            default the model's ``name_or_path`` and ``seed``.

    Returns:
        An :class:`EvalResult` over this call's samples, methods and budgets (reused predictions
        included).

    Raises:
        ValueError: an invalid spec or budget, no samples, or ``out_dir`` holding another run.
    """
    config = run_config or {"model": model_name(model), "seed": seed}
    sweep = EvalSweep(samples, methods, budgets, config, query_aware, seed, out_dir, progress)
    return sweep.run(local_runner(model, tokenizer))


@dataclass(frozen=True)
class EvalSweep:
    """A quality sweep, ready to be answered by any :data:`~kvfold.evaluate.running.sweep.ItemRunner`.

    :func:`evaluate` runs one here; ``run_on_ray(loader, sweep.run)``
    (:func:`kvfold.evaluate.running.distributed.run_on_ray`) on Ray workers.

    Attributes:
        samples, methods, budgets, query_aware, seed, out_dir, progress: as for :func:`evaluate`.
        run_config: what identifies the run for resuming (model, dataset, length, seed).
    """

    samples: Sequence[Sample]
    methods: Sequence[str]
    budgets: Sequence[float | int | str | Budget]
    run_config: Mapping[str, Any]
    query_aware: bool = False
    seed: int = 0
    out_dir: str | Path | None = None
    progress: bool = True

    def run(self, runner: ItemRunner) -> EvalResult:
        """Answer the sweep with ``runner`` (serial here, or a cluster), and score the answers.

        The sweep is cut into :class:`WorkItem` s (answers already in ``out_dir`` left out); the
        runner's rows are kept once each (by sample, method, budget and query-awareness), appended
        to ``predictions.jsonl`` as they arrive and counted by the progress bar; at the end the rows
        of this call are put in the serial order in the file, so it reads as a serial run's would.

        Returns:
            An :class:`EvalResult`, as :func:`evaluate`.

        Raises:
            ValueError: an invalid spec or budget, no samples, or ``out_dir`` holding another run.
            RuntimeError: the runner ended without producing every answer.
            OutputError: ``out_dir`` is in use by another run, or a file cannot be written.
            SweepInterrupted: Ctrl-C (the answers finished before it are kept in ``out_dir``).
        """
        if not self.samples:
            raise UserError("no samples to evaluate")
        runs = plan_runs(self.methods, self.budgets)
        config = dict(self.run_config)
        keys = sample_keys(self.samples)
        with open_run(self.out_dir, config, PREDICTIONS_FILE, row_key) as (out_dir, path, done):
            if path is not None:
                _check_stale_rows(path, done.values(), dict(zip(keys, self.samples, strict=True)))
            items = plan_items(self.samples, runs, done, query_aware=self.query_aware, seed=self.seed)
            collect_rows(runner, items, done, path=path, total=len(self.samples) * len(runs), progress=self.progress)
            predictions = [done[unit_key(k, spec, b.label(), self.query_aware)] for spec, b in runs for k in keys]
            result = EvalResult(
                model=str(config.get("model", "")),
                records=aggregate(predictions),
                predictions=predictions,
                out_dir=out_dir,
            )
            if out_dir is not None:
                write_json(out_dir / RESULTS_FILE, result.to_json())
                write_eval_report(out_dir, result.records, title_info=config)
        return result


def _check_stale_rows(path: Path, rows: Iterable[Mapping[str, Any]], samples: Mapping[str, Sample]) -> None:
    """Refuse to resume from answers to another version of a sample (same id, other text).

    A sample id names a task, length, seed and index; if the generator or the user's file changed
    since the answers were written, reusing them would mix two datasets in one report.
    """
    for row in rows:
        sample = samples.get(row["sample_id"])
        if sample is None:
            continue
        stale = ("context_id" in row and row["context_id"] != context_id(sample.context)) or (
            "answers" in row and list(row["answers"]) != list(sample.answers)
        )
        if stale:
            raise UserError(
                f"{path} holds an answer to sample {row['sample_id']!r} written for another version of "
                "its context or answers (the dataset changed since that run); use a new --out directory, "
                "or delete that file's rows of the changed tasks to rerun them"
            )


def context_id(context: str) -> str:
    """A short stable id of a context text: questions that share it are one bootstrap cluster."""
    return hashlib.sha1(context.encode("utf-8")).hexdigest()[:12]


def answer_context(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    group: Sequence[Sample],
    sample_ids: Sequence[str],
    runs: Sequence[tuple[str, Budget]],
    *,
    query_aware: bool = False,
    seed: int = 0,
    skip: Collection[tuple[str, str, str, bool]] = (),
    on_method: Callable[[str, Budget], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The unit of work of a sweep: one context, prefilled once, compressed once per (method, budget).

    Every question of ``group`` (samples sharing one context and prompt format) is answered from its
    own copy of the same compressed cache, so a context's questions cost one compression.

    Args:
        model, tokenizer: the model (kvfold attention) and its tokenizer.
        group: samples that share a context (one sample when ``query_aware``).
        sample_ids: their ids (:func:`~kvfold.evaluate.running.sweep.sample_keys`).
        runs: ``(method spec, budget)`` pairs to run.
        query_aware: compress the context together with the (single) question.
        seed: seed for randomized methods.
        skip: unit keys ``(sample_id, method, budget label json, query_aware)`` already done.
        on_method: called before each (method, budget) is compressed (progress display).

    Yields:
        One prediction row per sample × (method, budget) not in ``skip``, as soon as it is scored.
    """
    built = {spec: build_method(spec) for spec, _ in runs}
    first = group[0]
    context = prefill(
        model,
        tokenizer,
        first.context,
        question=_question(first) if query_aware else None,
        query_aware=query_aware,
        answer_prefix=first.answer_prefix if query_aware else "",
        use_chat_template=_use_chat_template(first),
        methods=list(built.values()),
    )
    cluster = context_id(first.context)
    for spec, budget in runs:
        todo = [
            (sample, sid)
            for sample, sid in zip(group, sample_ids, strict=True)
            if unit_key(sid, spec, budget.label(), query_aware) not in skip
        ]
        if not todo:
            continue
        if on_method is not None:
            on_method(spec, budget)
        compressed = context.compress(built[spec], budget, seed=seed)
        for sample, sid in todo:
            row = {"sample_id": sid, "context_id": cluster, "task": sample.task, "haystack": sample.haystack}
            row.update(method=spec, budget=budget.label(), query_aware=query_aware)
            row.update(_answer(context, compressed, sample, query_aware))
            yield row


def _answer(
    context: PrefilledContext, compressed: CompressedContext, sample: Sample, query_aware: bool
) -> dict[str, Any]:
    """One sample answered from its copy of a compressed cache and scored: the rest of its prediction row."""
    answer = compressed.generate(
        "" if query_aware else _question(sample),
        answer_prefix="" if query_aware else sample.answer_prefix,
        max_new_tokens=sample.max_new_tokens,
        use_chat_template=_use_chat_template(sample),
    )[0]
    metrics = score_sample_metrics(sample, answer.text)
    row = {
        "prediction": answer.text,
        "answers": list(sample.answers),
        "score": metrics[sample.metric],
        **compressed.memory_record(),
        "context_tokens": context.context_tokens,
        "prefill_seconds": context.prefill_seconds,
        "compress_seconds": compressed.compress_seconds,
        "decode_seconds": answer.decode_seconds,
        "new_tokens": answer.new_tokens,
    }
    if len(metrics) > 1:
        row["metrics"] = metrics
    return row


def _prefill_groups(samples: Sequence[Sample], query_aware: bool) -> Iterator[list[Sample]]:
    """Samples that share one prefill: same context and prompt format (one sample each if query-aware)."""
    for _, group in group_by_context(samples):
        by_format: dict[bool, list[Sample]] = {}
        for sample in group:
            by_format.setdefault(sample.chat_template, []).append(sample)
        for same in by_format.values():
            if query_aware:
                yield from ([s] for s in same)
            else:
                yield same
