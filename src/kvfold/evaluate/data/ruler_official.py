"""Data prepared by RULER's own scripts (Hsieh et al., 2024), or a hub copy of it (:func:`load_ruler_official`).

The synthetic suite generated here is :mod:`kvfold.evaluate.data.ruler`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfold.evaluate.data.hub import first_rows, hub_rows, local_rows
from kvfold.evaluate.data.ruler import RULER_MAX_NEW_TOKENS, RULER_TASKS
from kvfold.evaluate.data.samples import Sample
from kvfold.runtime.errors import UserError

__all__ = ["RULER_QUESTION_MARKERS", "load_ruler_official"]

RULER_QUESTION_MARKERS: tuple[str, ...] = (
    "\nWhat are all the special magic",
    "\n\nAnswer the question based on the given documents.",
    "\nQuestion:",
)
"""Where the question starts in a RULER ``input`` (tried in order; the last occurrence is used)."""


def _ruler_split(text: str, markers: Sequence[str], where: str) -> tuple[str, str]:
    """Splits a RULER prompt into context and question at the last occurrence of a marker."""
    for marker in markers:
        position = text.rfind(marker)
        if position > 0:
            return text[:position], text[position:]
    raise UserError(
        f"{where}: cannot find where the question starts (looked for {list(markers)}); "
        "add 'context' and 'question' fields or pass question_marker="
    )


def _ruler_answers(row: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """RULER's ``outputs`` (or ``answers``/``answer``) as a tuple of strings."""
    for field in ("outputs", "answers", "answer"):
        value = row.get(field)
        if value is not None:
            return (value,) if isinstance(value, str) else tuple(str(v) for v in value)
    raise UserError(f"{where}: no 'outputs' (or 'answers') field")


def _ruler_official_sample(row: Mapping[str, Any], task: str, index: int, markers: Sequence[str]) -> Sample:
    """A row of RULER's prepared data as a sample."""
    task = str(row.get("task") or task)
    where = f"RULER {task} sample {index}"
    if row.get("context") is not None and row.get("question") is not None:
        context, question = row["context"], row["question"]
    elif isinstance(row.get("input"), str):
        context, question = _ruler_split(row["input"], markers, where)
    else:
        raise UserError(f"{where}: needs an 'input' string (or 'context' and 'question' fields)")
    base_task = next((t for t in RULER_TASKS if task.startswith(t)), task)
    length = row.get("length")
    return Sample(
        context=context,
        question=question,
        answers=_ruler_answers(row, where),
        task=task,
        answer_prefix=(row.get("answer_prefix") or "").strip(),
        max_new_tokens=int(row.get("max_new_tokens") or RULER_MAX_NEW_TOKENS.get(base_task, 128)),
        metric="string_match_part" if base_task.startswith("qa") else "string_match_all",
        sample_id=f"{task}/{row.get('index', index)}",
        length=int(length) if length is not None else None,
    )


def _ruler_local_files(root: Path, tasks: Sequence[str] | None, split: str) -> list[tuple[str, Path]]:
    """``(task, file)`` pairs of a local RULER copy: a file, ``{task}/{split}.jsonl`` or ``{task}.jsonl``."""
    if root.is_file():
        task = root.parent.name if root.stem in ("validation", "test", split) else root.stem
        return [(task, root)]
    found = {p.parent.name: p for p in sorted(root.glob(f"*/{split}.jsonl"))}
    found.update({p.stem: p for p in sorted(root.glob("*.jsonl")) if p.stem not in found})
    names = list(found) if tasks is None else list(tasks)
    missing = [t for t in names if t not in found]
    if missing:
        raise FileNotFoundError(f"no RULER data for {missing} in {root} (looked for {{task}}/{split}.jsonl)")
    if not names:
        raise FileNotFoundError(f"no RULER data in {root} (looked for {{task}}/{split}.jsonl and *.jsonl)")
    return [(t, found[t]) for t in names]


def load_ruler_official(
    path_or_repo: str | Path,
    tasks: Sequence[str] | None = None,
    split: str = "validation",
    max_samples: int | None = None,
    *,
    config: str | None = None,
    question_marker: str | None = None,
    cache_dir: str | None = None,
) -> list[Sample]:
    """Loads data prepared by RULER's own scripts (or a hub copy of it).

    RULER writes ``{task}/validation.jsonl`` with ``input`` (the whole prompt), ``outputs``,
    ``length`` and ``answer_prefix``. The prompt is split into ``context`` and ``question`` at the
    last occurrence of the first of :data:`RULER_QUESTION_MARKERS` found (RULER's templates put the
    question after the context), or at ``question_marker``; rows that already have ``context``
    and ``question`` fields are used as they are.

    Args:
        path_or_repo: A RULER ``.jsonl`` file, a folder of ``{task}/{split}.jsonl`` (or
            ``{task}.jsonl``) files, or a hub dataset repo.
        tasks: Tasks to read from a folder (all found when ``None``); for a hub repo, the configs
            to load (default: ``config``).
        split: File stem in a folder, or hub split.
        max_samples: At most this many samples per task.
        config: Hub config when ``tasks`` is not given.
        question_marker: Text that starts the question, overriding the built-in markers.
        cache_dir: ``datasets`` cache folder.

    Returns:
        Samples scored with ``string_match_all`` (``string_match_part`` for ``qa_*``).
    """
    markers = (question_marker,) if question_marker else RULER_QUESTION_MARKERS
    local = Path(path_or_repo)
    if local.exists():
        files = _ruler_local_files(local, tasks, split)
        sources = [(task, local_rows(file, cache_dir)) for task, file in files]
    else:
        hint = "Pass a local RULER file or a folder of {task}/validation.jsonl files instead."
        configs = list(tasks) if tasks is not None else [config]
        sources = [(c or "ruler", hub_rows(str(path_or_repo), c, split, cache_dir, hint)) for c in configs]
    return [
        _ruler_official_sample(row, task, i, markers)
        for task, rows in sources
        for i, row in enumerate(first_rows(rows, max_samples))
    ]
