"""Finished runs read back from their folders, one or several merged (``kvfold report``).

An eval run folder (``kvfold eval --out``, :func:`kvfold.evaluate.running.runner.evaluate`) holds
``run.json`` (its configuration), ``predictions.jsonl`` (one row per sample × method × budget)
and, once the run is complete, ``results.json`` (the records); a fidelity run folder
(``kvfold fidelity --out``, :func:`kvfold.evaluate.running.fidelity.fidelity`) holds ``run.json``,
``fidelity_samples.jsonl`` and ``fidelity.json``. :func:`read_run` reads either back;
:func:`merge_runs` gives the records of several runs of one kind on the same samples as if they
were one run (e.g. one run per set of methods, only one of them with ``full``): their rows are put
together and aggregated again, so a method of one eval run gets its retention against the ``full``
of another. One finished run alone keeps the records it wrote.

Example:
    >>> from kvfold.evaluate.reporting import eval_markdown
    >>> records, config = merge_runs([read_run("runs/full-and-snapkv"), read_run("runs/kvzip")])
    >>> print(eval_markdown(records, config))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfold.evaluate.running.fidelity import FIDELITY_FILE, SAMPLES_FILE, aggregate_fidelity, fidelity_row_key
from kvfold.evaluate.running.runner import PREDICTIONS_FILE, RESULTS_FILE, row_key
from kvfold.evaluate.running.sweep import RUN_FILE, config_changes, read_predictions
from kvfold.evaluate.scoring.records import aggregate
from kvfold.runtime.errors import UserError

__all__ = ["RUN_KINDS", "Run", "RunKind", "group_runs", "merge_runs", "read_run"]


@dataclass(frozen=True)
class RunKind:
    """What a kind of run writes, and how its rows become records."""

    name: str
    rows_file: str
    results_file: str
    row_key: Callable[[Mapping[str, Any]], Any]
    aggregate: Callable[[Sequence[Mapping[str, Any]]], list[dict[str, Any]]]


RUN_KINDS = (
    RunKind("eval", PREDICTIONS_FILE, RESULTS_FILE, row_key, aggregate),
    RunKind("fidelity", SAMPLES_FILE, FIDELITY_FILE, fidelity_row_key, aggregate_fidelity),
)
"""The runs a folder can hold: ``kvfold eval``'s and ``kvfold fidelity``'s."""


@dataclass
class Run:
    """One run folder, read back.

    Attributes:
        path: the folder.
        kind: what wrote it (:data:`RUN_KINDS`).
        config: its ``run.json`` (model, dataset, length, seed, ...); empty when the file is missing.
        rows: the rows of its rows file, in file order.
        records: the records of its results file, or None when the run did not finish.
    """

    path: Path
    kind: RunKind
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    records: list[dict[str, Any]] | None = None


def read_run(run_dir: str | Path) -> Run:
    """Read an eval or fidelity run folder; nothing in it is changed (a torn last row is left out).

    Raises:
        ValueError: the folder holds neither ``predictions.jsonl`` nor ``fidelity_samples.jsonl``, a
            damaged row (its line number) or a damaged JSON file.
    """
    path = Path(run_dir)
    kind = next((k for k in RUN_KINDS if (path / k.rows_file).is_file()), None)
    if kind is None:
        files = " or ".join(k.rows_file for k in RUN_KINDS)
        raise UserError(f"{path} holds no {files}: not a directory written by kvfold eval, fidelity or bench --out")
    config = _read_json(path / RUN_FILE) if (path / RUN_FILE).is_file() else {}
    results = path / kind.results_file
    records = _read_json(results)["records"] if results.is_file() else None
    rows = read_predictions(path / kind.rows_file, repair=False, row_key=kind.row_key)
    return Run(path, kind, config, rows, records)


def _read_json(path: Path) -> Any:
    """A JSON file of a run folder; a damaged one is said with its path."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({err}): it was edited or damaged; correct it or rerun") from None


def merge_runs(runs: Sequence[Run]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of several runs of one kind on the same samples as one set, and their configuration.

    One finished run keeps the records it wrote. Otherwise the runs' rows are aggregated together:
    runs in the order given, each run's (method, budget) rows in the order of its own records; a
    row given by two runs (e.g. ``full`` in both) is taken from the first.

    Raises:
        ValueError: no run; runs of different kinds or configurations (model, dataset, length,
            seed, ...), or a sample whose context or answers differ between runs (they are not on
            the same samples).
    """
    if not runs:
        raise UserError("give at least one run folder")
    first = runs[0]
    for run in runs[1:]:
        if run.kind != first.kind:
            raise UserError(
                f"{run.path} was written by kvfold {run.kind.name}, {first.path} by kvfold {first.kind.name}: "
                "only runs of one kind can be merged"
            )
        changed = config_changes(first.config, run.config)
        if changed:
            raise UserError(
                f"{run.path} is another configuration than {first.path} ({'; '.join(changed)}); "
                "only runs on the same samples can be merged"
            )
    if len(runs) == 1 and first.records is not None:
        return first.records, dict(first.config)
    return first.kind.aggregate(_merged_rows(runs)), dict(first.config)


def group_runs(runs: Sequence[Run]) -> list[list[Run]]:
    """The runs split into groups that :func:`merge_runs` can merge: one kind and one configuration
    (model, dataset, length, seed, ...) each, groups and runs in the order given.

    ``kvfold report runs/ruler runs/mine`` on runs of two datasets gives one report per dataset.
    """
    groups: list[list[Run]] = []
    for run in runs:
        group = next((g for g in groups if g[0].kind == run.kind and not config_changes(g[0].config, run.config)), None)
        if group is None:
            groups.append([run])
        else:
            group.append(run)
    return groups


def describe_config(config: Mapping[str, Any]) -> str:
    """``"ruler @ 2048 tokens, smollm2-135m, seed 0"``: what a group of runs measured, for a heading."""
    parts = [f"{config.get('dataset', '?')} @ {config.get('length', '?')} tokens"]
    parts += [str(config["model"])] if config.get("model") else []
    parts += [f"seed {config['seed']}"] if config.get("seed") not in (None, 0) else []
    parts += [f"{k} {config[k]}" for k in sorted(config) if k not in ("dataset", "length", "model", "seed")]
    return ", ".join(parts)


def _merged_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every run's rows, the first of each key kept; a sample must be the same one in every run."""
    kept: dict[Any, dict[str, Any]] = {}
    first_seen: dict[str, dict[str, Any]] = {}
    for run in runs:
        for row in _in_record_order(run):
            earlier = first_seen.setdefault(row["sample_id"], row)
            known = [k for k in ("context_id", "answers") if earlier.get(k) is not None and row.get(k) is not None]
            if any(earlier[k] != row[k] for k in known):
                raise UserError(
                    f"sample {row['sample_id']!r} of {run.path} has another context or answers than in an "
                    "earlier run: the runs are not on the same samples"
                )
            kept.setdefault(run.kind.row_key(row), row)
    return list(kept.values())


def _in_record_order(run: Run) -> list[dict[str, Any]]:
    """The run's rows grouped as its records list them (method, budget, query-awareness); file order within."""
    if run.records is None:
        return run.rows
    order: dict[tuple[str, Any, bool], int] = {}
    for record in run.records:
        order.setdefault(_group(record), len(order))
    return sorted(run.rows, key=lambda row: order.get(_group(row), len(order)))


def _group(row: Mapping[str, Any]) -> tuple[str, Any, bool]:
    """The (method, budget, query-awareness) a row or a record belongs to."""
    return row["method"], row["budget"], bool(row.get("query_aware"))
