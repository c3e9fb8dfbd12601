"""Quality sweeps: every sample × method × budget, prefilling each context once.

The protocol of ``shared/guide/evaluation.md``: by default **query-agnostic** — a context is
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
* ``report.md`` and PNG plots (see :mod:`kvfold.evaluate.reporting.report`).

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
import math
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.evaluate.scoring.metrics import score_sample_metrics
from kvfold.evaluate.scoring.stats import Interval, TaskScores, macro_retention, macro_score, task_retention, task_score
from kvfold.methods import build_method
from kvfold.methods.core.model import model_name
from kvfold.pipeline.context import prefill
from kvfold.runtime.budget import Budget

__all__ = [
    "EvalResult",
    "ItemRunner",
    "SweepItem",
    "WorkItem",
    "aggregate",
    "answer_context",
    "collect_rows",
    "context_id",
    "evaluate",
    "local_runner",
    "plan_items",
    "plan_runs",
    "row_key",
    "run_item",
    "run_sweep",
    "sample_keys",
]

PREDICTIONS_FILE = "predictions.jsonl"
RESULTS_FILE = "results.json"
RUN_FILE = "run.json"
AVERAGE_TASK = "average"
HEADLINE_TASK = "headline"
SUMMARY_TASKS = (AVERAGE_TASK, HEADLINE_TASK, f"{HEADLINE_TASK}_noise", f"{HEADLINE_TASK}_prose")
"""The task names of average rows (see :func:`aggregate`)."""


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
        label = 1.0 if _is_full(method) else Budget.parse(budget).label()
        for record in self.records:
            if record["method"] == method and record["budget"] == label and record["task"] == task:
                return record["score"]
        raise KeyError(f"no result for method {method!r}, budget {label}, task {task!r}")

    def to_json(self) -> dict[str, Any]:
        """The content of ``results.json``."""
        return {"model": self.model, "records": self.records}


def _is_full(spec: str) -> bool:
    return build_method(spec).is_identity


def _names_full(label: str) -> bool:
    """Whether a result's method label is the uncompressed cache (False for labels of no method)."""
    try:
        return _is_full(label)
    except ValueError:
        return False


def plan_runs(methods: Sequence[str], budgets: Sequence[float | int | str | Budget]) -> list[tuple[str, Budget]]:
    """The (method spec, budget) pairs a sweep runs: ``full`` once at 1.0, others at every budget.

    Raises:
        ValueError: no method or no budget, or an invalid spec or budget.
    """
    if not methods:
        raise ValueError("give at least one method (e.g. full,streamingllm)")
    parsed = list(dict.fromkeys(Budget.parse(b) for b in budgets))
    runs: list[tuple[str, Budget]] = []
    for spec in dict.fromkeys(methods):
        if _is_full(spec):
            runs.append((spec, Budget.parse(1.0)))
        elif not parsed:
            raise ValueError("give at least one budget (e.g. 0.5,0.2)")
        else:
            runs.extend((spec, b) for b in parsed)
    return runs


def sample_keys(samples: Sequence[Sample]) -> list[str]:
    """A unique id per sample: its ``sample_id`` (or ``task/index``), suffixed ``#k`` on repeats."""
    seen: dict[str, int] = {}
    keys = []
    for index, sample in enumerate(samples):
        base = sample.sample_id or f"{sample.task}/{index}"
        seen[base] = seen.get(base, 0) + 1
        keys.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return keys


def _unit_key(sample_id: str, method: str, budget: float | int, query_aware: bool) -> tuple[str, str, str, bool]:
    return sample_id, method, json.dumps(budget), bool(query_aware)


def row_key(row: Mapping[str, Any]) -> tuple[str, str, str, bool]:
    """The key that identifies a prediction row in a sweep: sample id, method, budget, query-awareness."""
    return _unit_key(row["sample_id"], row["method"], row["budget"], row["query_aware"])


def _use_chat_template(sample: Sample) -> bool | None:
    """``None`` (the model's template when it has one) unless the sample asks for a raw prompt."""
    return None if sample.chat_template else False


def _question(sample: Sample) -> str:
    """The question as the pipeline appends it: :func:`build_prompt` adds its own separator."""
    return sample.question.lstrip()


def check_run_config(out_dir: Path, config: Mapping[str, Any]) -> None:
    """Write ``run.json`` on the first run; on a rerun, refuse a different configuration."""
    path = out_dir / RUN_FILE
    config = json.loads(json.dumps(dict(config)))
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        changed = [
            f"{k}: {stored.get(k)!r} → {config.get(k)!r}"
            for k in sorted(set(stored) | set(config))
            if stored.get(k) != config.get(k)
        ]
        if changed:
            raise ValueError(
                f"{out_dir} holds a run with another configuration ({'; '.join(changed)}); "
                "use a new --out directory to start a new run"
            )
        return
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """Predictions already written; a torn last line (an interrupted write) is dropped from the file."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    complete, rows = lines[:-1], []  # the part after the last newline is empty or torn
    for number, line in enumerate(complete, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path} line {number} is not valid JSON; remove it to resume") from None
    if lines[-1].strip():
        path.write_text("".join(line + "\n" for line in complete), encoding="utf-8")
    return rows


HEADLINE_MIN_FULL_SCORE = 50.0
"""A task whose full-cache score is below this says nothing about compression: it is reported
apart and left out of the headline average."""


def _task_scores(preds: Sequence[Mapping[str, Any]]) -> TaskScores:
    ordered = sorted(preds, key=lambda p: p.get("sample_id", ""))
    return TaskScores.from_pairs(
        [(p.get("context_id") or p.get("sample_id") or str(i), p["score"]) for i, p in enumerate(ordered)]
    )


def _interval_fields(prefix: str, interval: Interval | None, scale: float = 1.0) -> dict[str, Any]:
    """``{prefix: value, prefix_ci: [low, high]}``; undefined numbers become None (JSON null)."""

    def number(x: float) -> float | None:
        return None if math.isnan(x) else x * scale

    if interval is None or math.isnan(interval.value):
        return {prefix: None, f"{prefix}_ci": None}
    ci = [number(interval.low), number(interval.high)]
    return {prefix: number(interval.value), f"{prefix}_ci": None if None in ci else ci}


def _full_predictions(predictions: Sequence[Mapping[str, Any]]) -> dict[tuple[bool, str], dict[str, Mapping[str, Any]]]:
    """The full cache's predictions by (query_aware, task), keyed by sample id."""
    full: dict[tuple[bool, str], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for p in predictions:
        if _names_full(p["method"]) and "sample_id" in p:
            full[(bool(p["query_aware"]), p["task"])][p["sample_id"]] = p
    return full


def _paired_full(preds: Sequence[Mapping[str, Any]], full: Mapping[str, Mapping[str, Any]]) -> TaskScores | None:
    """The full cache's scores on exactly these samples, or None if it did not answer all of them.

    They are grouped by the method's context ids, so the two sides pair up even when one side's
    rows were written without ``context_id`` (predictions from before it existed, on resume).
    """
    if not full or any(p.get("sample_id") not in full for p in preds):
        return None
    return _task_scores([{**full[p["sample_id"]], "context_id": p.get("context_id")} for p in preds])


def aggregate(predictions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records per (method, budget, task) and average rows per (method, budget).

    Per task: ``score`` (mean per-sample score, 0-100) with ``score_ci`` (95%), ``retention``
    (score / the full cache's score on the same samples, a fraction) with ``retention_ci``, when a
    ``full`` run answered the same samples; ``headline`` (the full cache scores at least
    :data:`HEADLINE_MIN_FULL_SCORE` on the task, or no ``full`` run to tell); ``haystack``;
    ``kv_ratio`` (mean compressed / full bytes); ``compress_over_prefill`` (mean compression
    seconds over the prefill seconds of the same context); other metric names hold their means.

    Averages (macro: each task weighs the same; intervals by a stratified paired bootstrap over
    contexts, see :mod:`kvfold.evaluate.scoring.stats`): ``"average"`` over every task, ``"headline"``
    over the headline tasks, ``"headline_noise"`` / ``"headline_prose"`` over the headline tasks
    of each haystack (a row is left out when it would cover no task). An average row lists its
    ``tasks``.
    """
    groups: dict[tuple[str, Any, bool], dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in predictions:
        groups[(p["method"], p["budget"], bool(p["query_aware"]))][p["task"]].append(p)
    full_by_task = _full_predictions(predictions)
    full_scores = {key: _task_scores(list(rows.values())).mean() for key, rows in full_by_task.items() if rows}
    records = []
    for (method, budget, query_aware), tasks in groups.items():
        rows = []
        method_scores: dict[str, TaskScores] = {}
        paired_full: dict[str, TaskScores | None] = {}
        for task, preds in tasks.items():
            scores = _task_scores(preds)
            full = _paired_full(preds, full_by_task.get((query_aware, task), {}))
            method_scores[task], paired_full[task] = scores, full
            full_score = full_scores.get((query_aware, task))
            row = {
                "method": method,
                "budget": budget,
                "task": task,
                **_interval_fields("score", task_score(scores)),
                **_interval_fields("retention", task_retention(scores, full) if full is not None else None),
                "n": len(preds),
                "contexts": len(scores.contexts),
                "headline": full_score is None or full_score >= HEADLINE_MIN_FULL_SCORE,
                "haystack": preds[0].get("haystack"),
                "query_aware": query_aware,
                "kv_ratio": _mean(p["kv_bytes"] / p["kv_bytes_full"] for p in preds),
                "compress_over_prefill": _mean(
                    p["compress_seconds"] / p["prefill_seconds"] for p in preds if p.get("prefill_seconds")
                ),
            }
            names = dict.fromkeys(name for p in preds for name in p.get("metrics", {}))
            row.update(
                {name: _mean(p["metrics"][name] for p in preds if name in p.get("metrics", {})) for name in names}
            )
            rows.append(row)
        headline = [r for r in rows if r["headline"]]
        selections = {
            AVERAGE_TASK: rows,
            HEADLINE_TASK: headline,
            f"{HEADLINE_TASK}_noise": [r for r in headline if r["haystack"] == "noise"],
            f"{HEADLINE_TASK}_prose": [r for r in headline if r["haystack"] == "prose"],
        }
        averages = []
        for name, chosen in selections.items():
            if not chosen:
                continue
            names = [r["task"] for r in chosen]
            fulls = {t: paired_full[t] for t in names}
            retention = (
                macro_retention({t: method_scores[t] for t in names}, fulls)  # type: ignore[arg-type]
                if all(f is not None for f in fulls.values())
                else None
            )
            averages.append(
                {
                    "method": method,
                    "budget": budget,
                    "task": name,
                    **_interval_fields("score", macro_score({t: method_scores[t] for t in names})),
                    **_interval_fields("retention", retention),
                    "n": sum(r["n"] for r in chosen),
                    "contexts": sum(r["contexts"] for r in chosen),
                    "tasks": names,
                    "query_aware": query_aware,
                    "kv_ratio": _mean(r["kv_ratio"] for r in chosen),
                    "compress_over_prefill": _mean(r["compress_over_prefill"] for r in chosen),
                }
            )
        records.extend([*rows, *averages])
    return records


def _mean(values: Any) -> float:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else float("nan")


@dataclass(frozen=True)
class WorkItem:
    """One context's share of a sweep: prefilled once, compressed once per (method, budget).

    The unit a sweep is cut into; :func:`run_item` answers it on any process that holds the
    model, so a sweep can run here (:func:`evaluate`) or on a cluster
    (:mod:`kvfold.evaluate.running.distributed`).

    Attributes:
        index: position of the item in the sweep (the serial order of its answers).
        samples: samples sharing one context and prompt format (one sample when query-aware).
        sample_ids: their ids (:func:`sample_keys`).
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
            _unit_key(sid, spec, budget.label(), self.query_aware)
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


class SweepItem(Protocol):
    """What every kind of work item offers (:class:`WorkItem`, fidelity's and bench's items), so one
    driver (:func:`collect_rows`) and one cluster runner (:class:`kvfold.evaluate.running.distributed.RayRunner`)
    serve them all.

    An item is a frozen dataclass with ``index`` (its place in the serial order) and ``skip`` (the
    keys of rows already delivered: a retried item gets ``skip | delivered``), picklable so it can
    travel to a worker.
    """

    index: int
    skip: frozenset

    @property
    def label(self) -> str: ...  # pragma: no cover - a protocol

    def unit_keys(self) -> list[Any]: ...  # pragma: no cover - a protocol

    def row_key(self, row: Mapping[str, Any]) -> Any: ...  # pragma: no cover - a protocol

    def run(
        self, model: Any, tokenizer: Any, status: Callable[[str], None] | None = None
    ) -> Iterator[dict[str, Any]]: ...  # pragma: no cover - a protocol


ItemRunner = Callable[[Sequence[SweepItem], Callable[[str], None]], Iterable[dict[str, Any]]]
"""Answers work items: ``runner(items, status)`` yields their rows in any order (a row may come
twice, e.g. when a lost worker's item is retried: the sweep keeps the first), and may call
``status(text)`` to show what it is doing next to the progress bar."""


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


def local_runner(model: Any, tokenizer: Any) -> ItemRunner:
    """The serial :data:`ItemRunner`: every item in order, on this process's model."""

    def run(items: Sequence[SweepItem], status: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield from item.run(model, tokenizer, status)

    return run


def collect_rows(
    runner: ItemRunner,
    items: Sequence[SweepItem],
    done: dict[Any, dict[str, Any]],
    *,
    path: Path | None,
    total: int,
    progress: bool = True,
    desc: str = "eval",
    unit: str = "answer",
) -> None:
    """Drive a sweep: run ``items`` through ``runner`` and keep each new row once, in ``done``.

    Each row is keyed by its item's ``row_key``; a row whose key is done already, or belongs to no
    item, is dropped (a retried item's repeat). New rows are appended to ``path`` as they arrive
    and counted by the progress bar (``total`` units, those done before counted at the start); at
    the end the rows of this call are put in the items' serial order in the file, so it reads as a
    serial run's would.

    Raises:
        RuntimeError: the runner ended without producing every row the items owe.
    """
    from tqdm.auto import tqdm

    order = {key: n for n, key in enumerate(key for item in items for key in item.unit_keys())}
    key_of = items[0].row_key if items else row_key
    written_before = path.stat().st_size if path is not None and path.exists() else 0
    writer = path.open("a", encoding="utf-8") if path is not None else None
    bar = tqdm(total=total, initial=total - len(order), disable=not progress, desc=desc, unit=unit, dynamic_ncols=True)
    arrived: list[Any] = []
    try:
        for row in runner(items, lambda text: bar.set_postfix_str(text, refresh=False)):
            key = key_of(row)
            if key not in order or key in done:
                continue  # a retried item's row that arrived before, or none of this sweep's
            done[key] = row
            arrived.append(key)
            if writer is not None:
                writer.write(json.dumps(row) + "\n")
                writer.flush()
            bar.update(1)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    missing = [key for key in order if key not in done]
    if missing:
        raise RuntimeError(f"{len(missing)} answers were not produced (first: {missing[0]}); rerun to resume")
    if path is not None and arrived != sorted(arrived, key=order.__getitem__):
        _rewrite_in_order(path, written_before, [done[k] for k in sorted(arrived, key=order.__getitem__)])


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
            (spec, b)
            for spec, b in runs
            if any(_unit_key(sid, spec, b.label(), query_aware) not in done for sid in ids)
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
    return run_sweep(
        local_runner(model, tokenizer),
        samples,
        methods,
        budgets,
        query_aware=query_aware,
        seed=seed,
        out_dir=out_dir,
        progress=progress,
        run_config=config,
    )


def run_sweep(
    runner: ItemRunner,
    samples: Sequence[Sample],
    methods: Sequence[str],
    budgets: Sequence[float | int | str | Budget],
    *,
    query_aware: bool = False,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    run_config: Mapping[str, Any],
) -> EvalResult:
    """:func:`evaluate` with the answering left to ``runner`` (serial here, or a cluster).

    The sweep is cut into :class:`WorkItem` s (answers already in ``out_dir`` left out), the
    runner's rows are kept once each (by sample, method, budget and query-awareness), appended to
    ``predictions.jsonl`` as they arrive and counted by the progress bar; at the end the rows of
    this call are put in the serial order in the file, so it reads as a serial run's would.

    Args:
        runner: answers the items (:func:`local_runner`, :class:`kvfold.evaluate.running.distributed.RayRunner`).
        samples, methods, budgets, query_aware, seed, out_dir, progress: as for :func:`evaluate`.
        run_config: what identifies the run for resuming (model, dataset, length, seed).

    Returns:
        An :class:`EvalResult`, as :func:`evaluate`.

    Raises:
        ValueError: an invalid spec or budget, no samples, or ``out_dir`` holding another run.
        RuntimeError: the runner ended without producing every answer.
    """
    if not samples:
        raise ValueError("no samples to evaluate")
    runs = plan_runs(methods, budgets)
    config = dict(run_config)
    keys = sample_keys(samples)
    done: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    path = None
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        check_run_config(out_dir, config)
        path = out_dir / PREDICTIONS_FILE
        for row in read_predictions(path):
            done[row_key(row)] = row
        _check_stale_rows(path, done.values(), dict(zip(keys, samples, strict=True)))
    items = plan_items(samples, runs, done, query_aware=query_aware, seed=seed)
    collect_rows(runner, items, done, path=path, total=len(samples) * len(runs), progress=progress)
    predictions = [done[_unit_key(k, spec, b.label(), query_aware)] for spec, b in runs for k in keys]
    result = EvalResult(
        model=str(config.get("model", "")), records=aggregate(predictions), predictions=predictions, out_dir=out_dir
    )
    if out_dir is not None:
        from kvfold.evaluate.reporting.report import write_eval_report

        (out_dir / RESULTS_FILE).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
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
            raise ValueError(
                f"{path} holds an answer to sample {row['sample_id']!r} written for another version of "
                "its context or answers (the dataset changed since that run); use a new --out directory, "
                "or delete that file's rows of the changed tasks to rerun them"
            )


def _rewrite_in_order(path: Path, keep_bytes: int, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace what follows the first ``keep_bytes`` bytes of ``path`` by ``rows``, atomically."""
    with path.open("rb") as f:
        head = f.read(keep_bytes)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(head)
        f.write("".join(json.dumps(row) + "\n" for row in rows).encode("utf-8"))
    os.replace(tmp, path)


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
        sample_ids: their ids (:func:`sample_keys`).
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
            if _unit_key(sid, spec, budget.label(), query_aware) not in skip
        ]
        if not todo:
            continue
        if on_method is not None:
            on_method(spec, budget)
        compressed = context.compress(built[spec], budget, seed=seed)
        for sample, sid in todo:
            answer = compressed.generate(
                "" if query_aware else _question(sample),
                answer_prefix="" if query_aware else sample.answer_prefix,
                max_new_tokens=sample.max_new_tokens,
                use_chat_template=_use_chat_template(sample),
            )[0]
            metrics = score_sample_metrics(sample, answer.text)
            row = {
                "sample_id": sid,
                "context_id": cluster,
                "task": sample.task,
                "haystack": sample.haystack,
                "method": spec,
                "budget": budget.label(),
                "query_aware": query_aware,
                "prediction": answer.text,
                "answers": list(sample.answers),
                "score": metrics[sample.metric],
                "kv_bytes": compressed.kv_bytes,
                "kv_bytes_full": compressed.kv_bytes_full,
                "context_tokens": context.context_tokens,
                "prefill_seconds": context.prefill_seconds,
                "compress_seconds": compressed.compress_seconds,
                "decode_seconds": answer.decode_seconds,
                "new_tokens": answer.new_tokens,
            }
            if len(metrics) > 1:
                row["metrics"] = metrics
            yield row


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
