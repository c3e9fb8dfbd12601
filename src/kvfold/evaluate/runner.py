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
* ``report.md`` and PNG plots (see :mod:`kvfold.evaluate.report`).

Example:
    >>> from kvfold import load_model
    >>> from kvfold.evaluate import evaluate, generate_ruler
    >>> model, tokenizer = load_model()
    >>> samples = generate_ruler(tokenizer, 2048, 2)
    >>> result = evaluate(model, tokenizer, samples, ["full", "streamingllm"], [0.2], out_dir="runs/a")
    >>> result.score("streamingllm", 0.2)  # average over tasks, 0-100
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.budget import Budget
from kvfold.evaluate.metrics import score_sample_metrics
from kvfold.evaluate.samples import Sample, group_by_context
from kvfold.methods import build_method
from kvfold.pipeline import prefill

__all__ = ["EvalResult", "aggregate", "evaluate", "plan_runs", "sample_keys"]

PREDICTIONS_FILE = "predictions.jsonl"
RESULTS_FILE = "results.json"
RUN_FILE = "run.json"
AVERAGE_TASK = "average"


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


def _use_chat_template(sample: Sample) -> bool | None:
    """``None`` (the model's template when it has one) unless the sample asks for a raw prompt."""
    return None if sample.chat_template else False


def _question(sample: Sample) -> str:
    """The question as the pipeline appends it: :func:`build_prompt` adds its own separator."""
    return sample.question.lstrip()


def _check_run_config(out_dir: Path, config: Mapping[str, Any]) -> None:
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


def aggregate(predictions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records per (method, budget, task) and an ``"average"`` task row per (method, budget).

    ``score`` is the mean per-sample score of a task; the average row is the macro average over
    tasks (each task weighs the same) with ``n`` the number of samples. ``kv_ratio`` is the mean
    of compressed over full cache bytes; other metric names hold their mean scores.
    """
    groups: dict[tuple[str, Any, bool], dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in predictions:
        groups[(p["method"], p["budget"], bool(p["query_aware"]))][p["task"]].append(p)
    records = []
    for (method, budget, query_aware), tasks in groups.items():
        rows = []
        for task, preds in tasks.items():
            row = {
                "method": method,
                "budget": budget,
                "task": task,
                "score": _mean(p["score"] for p in preds),
                "n": len(preds),
                "query_aware": query_aware,
                "kv_ratio": _mean(p["kv_bytes"] / p["kv_bytes_full"] for p in preds),
            }
            names = dict.fromkeys(name for p in preds for name in p.get("metrics", {}))
            row.update(
                {name: _mean(p["metrics"][name] for p in preds if name in p.get("metrics", {})) for name in names}
            )
            rows.append(row)
        average = {
            "method": method,
            "budget": budget,
            "task": AVERAGE_TASK,
            "score": _mean(r["score"] for r in rows),
            "n": sum(r["n"] for r in rows),
            "query_aware": query_aware,
            "kv_ratio": _mean(r["kv_ratio"] for r in rows),
        }
        records.extend([*rows, average])
    return records


def _mean(values: Any) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")


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
    from tqdm.auto import tqdm

    if not samples:
        raise ValueError("no samples to evaluate")
    runs = plan_runs(methods, budgets)
    built = {spec: build_method(spec) for spec, _ in runs}
    config = dict(
        run_config or {"model": getattr(model.config, "name_or_path", "") or type(model).__name__, "seed": seed}
    )
    keys = sample_keys(samples)
    done: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    writer = None
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        _check_run_config(out_dir, config)
        for row in read_predictions(out_dir / PREDICTIONS_FILE):
            done[_unit_key(row["sample_id"], row["method"], row["budget"], row["query_aware"])] = row
        writer = (out_dir / PREDICTIONS_FILE).open("a", encoding="utf-8")
    key_of = {id(s): k for s, k in zip(samples, keys, strict=True)}
    todo = sum(_unit_key(key_of[id(s)], spec, b.label(), query_aware) not in done for s in samples for spec, b in runs)
    total = len(samples) * len(runs)
    bar = tqdm(total=total, initial=total - todo, disable=not progress, desc="eval", unit="answer", dynamic_ncols=True)
    try:
        for group in _prefill_groups(samples, query_aware):
            pending = [
                (spec, b)
                for spec, b in runs
                if any(_unit_key(key_of[id(s)], spec, b.label(), query_aware) not in done for s in group)
            ]
            if not pending:
                continue
            first = group[0]
            context = prefill(
                model,
                tokenizer,
                first.context,
                question=_question(first) if query_aware else None,
                query_aware=query_aware,
                answer_prefix=first.answer_prefix if query_aware else "",
                use_chat_template=_use_chat_template(first),
                methods=[built[spec] for spec, _ in pending],
            )
            for spec, budget in pending:
                bar.set_postfix_str(f"{spec} @ {budget}", refresh=False)
                compressed = context.compress(built[spec], budget, seed=seed)
                for sample in group:
                    key = _unit_key(key_of[id(sample)], spec, budget.label(), query_aware)
                    if key in done:
                        continue
                    answer = compressed.generate(
                        "" if query_aware else _question(sample),
                        answer_prefix="" if query_aware else sample.answer_prefix,
                        max_new_tokens=sample.max_new_tokens,
                        use_chat_template=_use_chat_template(sample),
                    )[0]
                    metrics = score_sample_metrics(sample, answer.text)
                    row = {
                        "sample_id": key_of[id(sample)],
                        "task": sample.task,
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
                    done[key] = row
                    if writer is not None:
                        writer.write(json.dumps(row) + "\n")
                        writer.flush()
                    bar.update(1)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    predictions = [done[_unit_key(key_of[id(s)], spec, b.label(), query_aware)] for spec, b in runs for s in samples]
    result = EvalResult(
        model=str(config.get("model", "")), records=aggregate(predictions), predictions=predictions, out_dir=out_dir
    )
    if out_dir is not None:
        from kvfold.evaluate.report import write_eval_report

        (out_dir / RESULTS_FILE).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        write_eval_report(out_dir, result.records, title_info=config)
    return result


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
