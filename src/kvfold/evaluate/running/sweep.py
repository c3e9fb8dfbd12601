"""What every sweep shares: work items, runners, the driver that keeps each row once, and resuming.

A sweep (a quality sweep, :mod:`kvfold.evaluate.running.runner`; fidelity,
:mod:`kvfold.evaluate.running.fidelity`; ``kvfold bench``, :mod:`kvfold.evaluate.bench.speed`) is cut
into work items (:class:`SweepItem`) that an :data:`ItemRunner` answers, here
(:func:`local_runner`) or on a cluster (:class:`kvfold.evaluate.running.distributed.RayRunner`).
:func:`collect_rows` keeps each row once, appends it to the sweep's file as it arrives and leaves
the file in the serial order; :func:`open_run` reads back what an interrupted run wrote, so a
rerun into the same folder does only what is missing.

Faults (:mod:`kvfold.runtime.files`): a run holds its folder alone (a second run on it is refused),
every row is on the disk before it is counted, a torn last row (a crash in the middle of a write)
is dropped and redone, and Ctrl-C ends the run with the count of finished rows kept
(:class:`SweepInterrupted`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from kvfold.evaluate.data.samples import Sample
from kvfold.methods import build_method
from kvfold.runtime.budget import Budget
from kvfold.runtime.errors import UserError
from kvfold.runtime.files import DirectoryLock, JsonlAppender, atomic_write_bytes, atomic_write_text, read_jsonl

__all__ = [
    "RUN_FILE",
    "ItemRunner",
    "SweepInterrupted",
    "SweepItem",
    "check_run_config",
    "collect_rows",
    "config_changes",
    "is_full",
    "keep_on_interrupt",
    "local_runner",
    "open_run",
    "plan_runs",
    "read_predictions",
    "sample_keys",
    "write_json",
]

RUN_FILE = "run.json"
"""The run's configuration in its folder; a rerun into the same folder must match it."""


def is_full(spec: str) -> bool:
    """Whether a method spec is the uncompressed cache (``full``).

    Raises:
        ValueError: an invalid spec.
    """
    return build_method(spec).is_identity


def plan_runs(methods: Sequence[str], budgets: Sequence[float | int | str | Budget]) -> list[tuple[str, Budget]]:
    """The (method spec, budget) pairs a sweep runs: ``full`` once at 1.0, others at every budget.

    Raises:
        ValueError: no method or no budget, or an invalid spec or budget.
    """
    if not methods:
        raise UserError("give at least one method (e.g. full,streamingllm)")
    parsed = list(dict.fromkeys(Budget.parse(b) for b in budgets))
    runs: list[tuple[str, Budget]] = []
    for spec in dict.fromkeys(methods):
        if is_full(spec):
            runs.append((spec, Budget.parse(1.0)))
        elif not parsed:
            raise UserError("give at least one budget (e.g. 0.5,0.2)")
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


def write_json(path: Path, payload: Any) -> None:
    """``payload`` as indented JSON with a final newline, as every results file is written (atomically).

    Raises:
        OutputError: the file cannot be written (the old one, if any, is left whole).
    """
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")


def config_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``"key: old → new"`` for every key whose value differs between two run configurations."""
    keys = sorted(set(before) | set(after))
    return [f"{k}: {before.get(k)!r} → {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)]


def check_run_config(out_dir: Path, config: Mapping[str, Any]) -> None:
    """Write ``run.json`` on the first run; on a rerun, refuse a different configuration."""
    path = out_dir / RUN_FILE
    config = json.loads(json.dumps(dict(config)))
    if path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise UserError(
                f"{path} is not valid JSON ({err}): it was edited or damaged; correct it, or use a new --out directory"
            ) from None
        changed = config_changes(before, config)
        if changed:
            raise UserError(
                f"{out_dir} holds a run with another configuration ({'; '.join(changed)}); "
                "use a new --out directory to start a new run"
            )
        return
    write_json(path, config)


def read_predictions(
    path: Path, *, repair: bool = True, row_key: Callable[[Mapping[str, Any]], Any] | None = None
) -> list[dict[str, Any]]:
    """Rows already written; a torn last line (an interrupted write) is left out, and with ``repair``
    dropped from the file (a rerun appends after it).

    Raises:
        ValueError: a line elsewhere that is not JSON (or has no ``row_key``), with its number; the
            file is not changed.
    """
    return read_jsonl(path, repair=repair, check=row_key, what="prediction row")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C ended a sweep; the message says how many finished rows its file keeps, and how to resume."""


@contextmanager
def keep_on_interrupt(path: Path | None, unit: str = "answer") -> Iterator[None]:
    """Turn Ctrl-C inside into a :class:`SweepInterrupted` that counts the ``unit`` s kept in ``path``.

    The rows are counted in the file, as a rerun will read them: a row written just before the
    interruption is kept even when the sweep had no time to count it.
    """
    try:
        yield
    except SweepInterrupted:
        raise
    except KeyboardInterrupt:
        if path is None:
            raise
        try:
            kept = f"{len(read_jsonl(path))} finished {unit}s kept"
        except (OSError, ValueError):
            kept = f"the finished {unit}s kept"
        raise SweepInterrupted(f"interrupted; {kept} in {path}: run the same command again to resume") from None


@contextmanager
def open_run(
    out_dir: str | Path | None,
    config: Mapping[str, Any],
    rows_file: str,
    row_key: Callable[[Mapping[str, Any]], Any],
    unit: str = "answer",
) -> Iterator[tuple[Path | None, Path | None, dict[Any, dict[str, Any]]]]:
    """The run's folder and rows file, and the rows an earlier run left there, by key, while the run holds it.

    The folder is made and locked (:class:`~kvfold.runtime.files.DirectoryLock`: a second run on it
    is refused) until the block ends, its ``run.json`` written or checked (:func:`check_run_config`),
    and a torn last row dropped (:func:`read_predictions`). Ctrl-C inside the block becomes a
    :class:`SweepInterrupted` counting the ``unit`` s kept. With no ``out_dir`` nothing is written.

    Yields:
        ``(out_dir, path of rows_file, {row_key(row): row})``; ``(None, None, {})`` without ``out_dir``.

    Raises:
        OutputError: the folder is in use by another run, or cannot be written.
        ValueError: another configuration in ``run.json``, or a damaged row.
    """
    if out_dir is None:
        yield None, None, {}
        return
    out_dir = Path(out_dir)
    with DirectoryLock(out_dir):
        check_run_config(out_dir, config)
        path = out_dir / rows_file
        done = {}
        for row in read_predictions(path, row_key=row_key):
            done[row_key(row)] = row
        with keep_on_interrupt(path, unit):
            yield out_dir, path, done


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
    item, is dropped (a retried item's repeat). New rows are appended to ``path`` as they arrive,
    each synced to disk before it counts (:class:`~kvfold.runtime.files.JsonlAppender`), and
    counted by the progress bar (``total`` units, those done before counted at the start); at the
    end the rows of this call are put in the items' serial order in the file (atomically), so it
    reads as a serial run's would.

    Raises:
        RuntimeError: the runner ended without producing every row the items owe.
        OutputError: a row cannot be written (the rows before it are kept).
    """
    from tqdm.auto import tqdm

    order = {key: n for n, key in enumerate(key for item in items for key in item.unit_keys())}
    key_of = items[0].row_key if items else (lambda row: None)  # no item: no row is awaited
    written_before = path.stat().st_size if path is not None and path.exists() else 0
    writer = JsonlAppender(path) if path is not None else None
    bar = tqdm(total=total, initial=total - len(order), disable=not progress, desc=desc, unit=unit, dynamic_ncols=True)
    arrived: list[Any] = []
    try:
        for row in runner(items, lambda text: bar.set_postfix_str(text, refresh=False)):
            key = key_of(row)
            if key not in order or key in done:
                continue  # a retried item's row that arrived before, or none of this sweep's
            if writer is not None:
                writer.write(row)  # on the disk before it counts as done
            done[key] = row
            arrived.append(key)
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


def _rewrite_in_order(path: Path, keep_bytes: int, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace what follows the first ``keep_bytes`` bytes of ``path`` by ``rows``, atomically."""
    with path.open("rb") as f:
        head = f.read(keep_bytes)
    atomic_write_bytes(path, head + "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8"))
