"""Bring-your-own data: a JSON Lines file of contexts, questions and answers (:func:`load_jsonl`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.scoring.metrics import METRICS
from kvfold.runtime.errors import UserError

__all__ = ["load_jsonl"]

_REQUIRED_FIELDS = ("context", "answers")


def _type_name(value: Any) -> str:
    """JSON-ish name of a value's type for error messages."""
    return "null" if value is None else type(value).__name__


def _string_list(record: Mapping[str, Any], field: str, where: str) -> tuple[str, ...]:
    """A field that must be a list of strings."""
    value = record[field]
    if not isinstance(value, list):
        raise UserError(f"{where}: {field!r} must be a list of strings, got {_type_name(value)}")
    for item in value:
        if not isinstance(item, str):
            raise UserError(f"{where}: {field!r} must be a list of strings, got an item of type {_type_name(item)}")
    return tuple(value)


def _optional_string(record: Mapping[str, Any], field: str, default: str, where: str) -> str:
    """An optional field that must be a string when present."""
    value = record.get(field, default)
    if not isinstance(value, str):
        raise UserError(f"{where}: {field!r} must be a string, got {_type_name(value)}")
    return value


def _questions(record: Mapping[str, Any], where: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(question, answers)`` pairs: one ``question`` with its ``answers`` list, or ``questions``
    (a list of strings) with ``answers`` as a list of answer lists, one per question."""
    if "questions" in record:
        if "question" in record:
            raise UserError(f"{where}: give either 'question' or 'questions', not both")
        questions = _string_list(record, "questions", where)
        if not questions:
            raise UserError(f"{where}: 'questions' must contain at least one string")
        answers = record["answers"]
        if not isinstance(answers, list) or len(answers) != len(questions):
            raise UserError(
                f"{where}: with 'questions', 'answers' must be a list of {len(questions)} answer lists "
                f"(one per question), got {_type_name(answers)}"
                + (f" of {len(answers)}" if isinstance(answers, list) else "")
            )
        pairs = []
        for k, (question, refs) in enumerate(zip(questions, answers, strict=True)):
            refs = _string_list({"answers": refs}, "answers", f"{where} question {k + 1}")
            if not refs:
                raise UserError(f"{where} question {k + 1}: its answer list must contain at least one string")
            pairs.append((question, refs))
        return pairs
    if "question" not in record:
        raise UserError(f"{where}: missing required field 'question' (or 'questions')")
    answers = _string_list(record, "answers", where)
    if not answers:
        raise UserError(f"{where}: 'answers' must contain at least one string")
    return [(_optional_string(record, "question", "", where), answers)]


def _samples_from_record(record: Any, where: str, default_task: str, line_number: int) -> list[Sample]:
    """Validates one JSONL record and builds its samples (one per question; they share the context)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: each line must be a JSON object, got {_type_name(record)}")
    missing = [field for field in _REQUIRED_FIELDS if field not in record]
    if missing:
        raise UserError(f"{where}: missing required field(s) {', '.join(map(repr, missing))}")
    context = _optional_string(record, "context", "", where)
    if not context.strip():
        raise UserError(f"{where}: 'context' must be a non-empty string")
    pairs = _questions(record, where)
    max_new_tokens = record.get("max_new_tokens", 32)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise UserError(f"{where}: 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
    metric = _optional_string(record, "metric", "string_match_all", where)
    if metric not in METRICS:
        raise UserError(f"{where}: unknown metric {metric!r}; valid metrics: {', '.join(sorted(METRICS))}")
    task = _optional_string(record, "task", default_task, where) or default_task
    sample_id = str(record.get("sample_id", record.get("id", f"{task}/{line_number}")))
    haystack = record.get("haystack")
    if haystack is not None and haystack not in ("noise", "prose"):
        raise UserError(f'{where}: \'haystack\' must be "noise" or "prose", got {haystack!r}')
    return [
        Sample(
            context=context,
            question=question,
            answers=answers,
            task=task,
            answer_prefix=_optional_string(record, "answer_prefix", "", where),
            max_new_tokens=max_new_tokens,
            metric=metric,
            sample_id=sample_id if len(pairs) == 1 else f"{sample_id}/q{k}",
            all_classes=() if record.get("all_classes") is None else _string_list(record, "all_classes", where),
            haystack=haystack,
        )
        for k, (question, answers) in enumerate(pairs)
    ]


def load_jsonl(path: str | Path) -> list[Sample]:
    """Loads a bring-your-own dataset: one JSON object a line.

    Fields: ``context`` (non-empty string), ``question`` (string, appended verbatim after the
    context, so start it with a newline if one is wanted) and ``answers`` (non-empty list of
    strings) are required — or, for several questions about one context, ``questions`` (a list of
    strings) with ``answers`` a list of answer lists, one per question (the context is compressed
    once and each question answered from a copy; sample ids get ``/q0``, ``/q1``, ...);
    ``haystack`` (``"noise"``/``"prose"``), ``answer_prefix`` (string), ``max_new_tokens`` (positive int, default
    32), ``task`` (string, default the file's stem), ``metric`` (a name in
    :data:`~kvfold.evaluate.scoring.metrics.METRICS`, default ``string_match_all``), ``id`` and
    ``all_classes`` are optional. Other keys are ignored; blank lines are skipped. Samples that
    share a context are compressed once by the pipeline (see
    :func:`~kvfold.evaluate.data.samples.group_by_context`).

    Args:
        path: The ``.jsonl`` file.

    Returns:
        The samples in file order.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On the first malformed line, naming the file and line number, e.g.
            ``data.jsonl line 7: 'answers' must be a list of strings, got str``; or if the file holds
            no samples.

    Example:
        >>> samples = load_jsonl("my_set.jsonl")  # doctest: +SKIP
    """
    path = Path(path)
    samples: list[Sample] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            samples.extend(_samples_from_record(record, where, path.stem, line_number))
    if not samples:
        raise UserError(f"{path}: no samples (the file is empty)")
    return samples
