"""Dataset loaders: bring-your-own JSONL, LongBench, RULER's official files, XSum and the synthetic RULER.

Every loader returns :class:`~kvfold.evaluate.data.samples.Sample` lists, and :func:`load_dataset_spec`
turns a command-line spec into one. Each source has its module: :mod:`~kvfold.evaluate.data.jsonl`,
:mod:`~kvfold.evaluate.data.longbench`, :mod:`~kvfold.evaluate.data.xsum`,
:mod:`~kvfold.evaluate.data.ruler_official` and :mod:`~kvfold.evaluate.data.ruler` (generated
locally). Published benchmarks are read with the optional ``datasets`` package
(``pip install 'kvfold[datasets]'``; :mod:`~kvfold.evaluate.data.hub`): from the hub with
``datasets.load_dataset(repo, config, split=...)``, or from a local copy of the same layout with
``datasets.load_dataset("json", data_files=...)``.
"""

from __future__ import annotations

from typing import Any

from kvfold.evaluate.data.hub import truncate_middle
from kvfold.evaluate.data.jsonl import load_jsonl
from kvfold.evaluate.data.longbench import LONGBENCH_TASKS, load_longbench
from kvfold.evaluate.data.ruler import HEADLINE_TASKS, RULER_TASKS, generate_ruler
from kvfold.evaluate.data.ruler_official import load_ruler_official
from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.data.xsum import load_xsum
from kvfold.runtime.errors import UserError

__all__ = [
    "DEFAULT_RULER_SAMPLES",
    "LONGBENCH_TASKS",
    "load_dataset_spec",
    "load_jsonl",
    "load_longbench",
    "load_ruler_official",
    "load_xsum",
    "truncate_middle",
]

DEFAULT_RULER_SAMPLES = 3
"""Samples per task for the ``ruler`` spec when none is given."""

_SPEC_FORMS = (
    "ruler",
    "ruler:TASK1,TASK2",
    "PATH.jsonl",
    "longbench",
    "longbench:TASK1,TASK2",
    "longbench[:TASKS]@DIR_OR_REPO",
    "xsum",
    "xsum@PATH_OR_REPO",
    "ruler-official[:TASKS]@PATH_OR_REPO",
)


def _parse_spec(spec: str) -> tuple[str, tuple[str, ...] | None, str | None]:
    """``"name:t1,t2@location"`` → ``(name, tasks or None, location or None)``."""
    head, _, location = spec.partition("@")
    name, _, task_list = head.partition(":")
    tasks = tuple(t.strip() for t in task_list.split(",") if t.strip()) or None
    return name.strip().lower(), tasks, location.strip() or None


def load_dataset_spec(
    spec: str,
    tokenizer: Any = None,
    length: int | None = None,
    samples: int | None = None,
    seed: int = 0,
) -> list[Sample]:
    """Loads the samples a command-line dataset spec names.

    Forms: ``ruler`` (the headline tasks, :data:`~kvfold.evaluate.data.ruler.HEADLINE_TASKS`) /
    ``ruler:TASK1,TASK2`` / ``ruler:all`` (synthetic, needs ``tokenizer`` and ``length``;
    ``samples`` contexts per task, default :data:`DEFAULT_RULER_SAMPLES`); ``PATH.jsonl`` (bring your own;
    first ``samples``); ``longbench`` / ``longbench:TASKS`` with an optional ``@DIR_OR_REPO``
    (``samples`` per task; with ``tokenizer`` and ``length``, prompts are middle-truncated to
    ``length`` tokens); ``xsum`` / ``xsum@PATH_OR_REPO``; ``ruler-official[:TASKS]@PATH_OR_REPO``.

    Args:
        spec: The dataset spec.
        tokenizer: The model's tokenizer (RULER lengths, LongBench/XSum truncation).
        length: Token length for RULER; prompt limit for LongBench and XSum.
        samples: Number of samples (per task where the form has tasks); all when ``None``.
        seed: RULER generation seed.

    Returns:
        The samples.

    Raises:
        ValueError: On an unknown spec, listing the valid forms, or when ``ruler`` lacks a
            tokenizer or length.

    Example:
        >>> load_dataset_spec("ruler:niah_single_1,vt", tokenizer, length=4096, samples=5)  # doctest: +SKIP
    """
    name, tasks, location = _parse_spec(spec)
    if name == "ruler" and location is None:
        if tokenizer is None or length is None:
            raise UserError("the 'ruler' dataset needs the model's tokenizer and a length in tokens")
        if tasks == ("all",):
            tasks = RULER_TASKS
        return generate_ruler(
            tokenizer, length, samples or DEFAULT_RULER_SAMPLES, seed=seed, tasks=tasks or HEADLINE_TASKS
        )
    if name == "longbench":
        return load_longbench(tasks, location or "THUDM/LongBench", samples, tokenizer=tokenizer, max_length=length)
    if name == "xsum" and tasks is None:
        return load_xsum(location or "EdinburghNLP/xsum", max_samples=samples, tokenizer=tokenizer, max_length=length)
    if name == "ruler-official" and location is not None:
        return load_ruler_official(location, tasks, max_samples=samples)
    if spec.lower().endswith(".jsonl"):
        loaded = load_jsonl(spec)
        return loaded if samples is None else loaded[:samples]
    raise UserError(f"unknown dataset spec {spec!r}; valid forms: {', '.join(_SPEC_FORMS)}")
