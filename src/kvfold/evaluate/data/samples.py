"""The evaluation sample: one question about one context, with its reference answers.

Every task generator and dataset loader in :mod:`kvfold.evaluate` returns a list of
:class:`Sample`. The prompt a model sees is ``context + question`` (plain concatenation, so a
``question`` carries its own leading separator where it needs one), followed by
``answer_prefix``. Under the query-agnostic protocol only ``context`` is compressed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvfold.runtime.errors import UserError

__all__ = ["Sample", "check_tasks", "group_by_context"]


@dataclass(frozen=True)
class Sample:
    """One evaluation item.

    Args:
        context: The long input that is prefilled and compressed.
        question: Text appended verbatim after ``context`` (instruction and question).
        answers: Reference answers; how they are used depends on ``metric``.
        task: Task name used to group scores (``"niah_single_1"``, ``"qasper"``, ...).
        answer_prefix: Text that starts the answer (e.g. ``"Answer:"``); the model continues it.
        max_new_tokens: Greedy decoding limit for this sample.
        metric: Name of the per-sample metric in :data:`kvfold.evaluate.scoring.metrics.METRICS`.
        sample_id: Identifier, unique within a dataset.
        depth: For needle tasks, where the needle holding ``answers[0]`` sits, as the fraction of
            the haystack's characters that precede it (0 = start, 1 = end); ``None`` otherwise.
        length: The target length in tokens the sample was generated for (synthetic tasks).
        haystack: What the context hides its facts in, for synthetic tasks: ``"noise"`` (repeated
            filler, word lists, distractor needles) or ``"prose"`` (English text); ``None`` otherwise.
        all_classes: Label set for ``classification_score`` (LongBench ``trec``).
        first_line_only: Score only the first non-empty line of the prediction (LongBench does
            this for few-shot tasks, whose models tend to continue with a new example).
        extra_metrics: Further metrics to report next to ``metric`` (XSum: ROUGE-1 and ROUGE-2).
        chat_template: Whether the prompt should be wrapped in the model's chat template
            (LongBench leaves few-shot and code-completion prompts unwrapped).

    Raises:
        TypeError: If ``answers`` is a single string instead of a sequence of strings.
        ValueError: If ``answers`` is empty or ``max_new_tokens`` is not positive.

    Example:
        >>> s = Sample(context="The sky is blue.", question="\\nWhat colour is the sky?",
        ...            answers=["blue"], task="demo")
        >>> s.answers
        ('blue',)
    """

    context: str
    question: str
    answers: tuple[str, ...]
    task: str
    answer_prefix: str = ""
    max_new_tokens: int = 32
    metric: str = "string_match_all"
    sample_id: str = ""
    depth: float | None = None
    length: int | None = None
    haystack: str | None = None
    all_classes: tuple[str, ...] = ()
    first_line_only: bool = False
    extra_metrics: tuple[str, ...] = ()
    chat_template: bool = True

    def __post_init__(self) -> None:
        for name in ("answers", "all_classes", "extra_metrics"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"Sample.{name} must be a sequence of strings, got a single str {value!r}")
            object.__setattr__(self, name, tuple(value))
        if not self.answers:
            raise UserError(f"Sample {self.sample_id or self.task!r} has no reference answers")
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be a positive int; got {self.max_new_tokens!r}")

    def to_dict(self) -> dict[str, Any]:
        """Returns the sample as a JSON-serialisable dict (tuples become lists)."""
        record = asdict(self)
        for name in ("answers", "all_classes", "extra_metrics"):
            record[name] = list(record[name])
        return record


def group_by_context(samples: Iterable[Sample]) -> list[tuple[str, list[Sample]]]:
    """Groups samples that share a context, so that each context is prefilled and compressed once.

    Args:
        samples: Samples in any order.

    Returns:
        ``(context, samples)`` pairs in the order each context is first seen; within a group the
        samples keep their input order.

    Example:
        >>> a = Sample("ctx", "\\nq1", ("x",), "t")
        >>> b = Sample("ctx", "\\nq2", ("y",), "t")
        >>> [(c, len(g)) for c, g in group_by_context([a, b])]
        [('ctx', 2)]
    """
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.context, []).append(sample)
    return list(groups.items())


def check_tasks(tasks: Sequence[str] | None, valid: Sequence[str], benchmark: str) -> tuple[str, ...]:
    """The requested task names (all of ``valid`` when ``None``), in the order asked.

    Raises:
        ValueError: A name not in ``valid``; the message lists the valid ones.
    """
    selected = tuple(valid if tasks is None else tasks)
    unknown = [t for t in selected if t not in valid]
    if unknown:
        raise UserError(f"unknown {benchmark} task(s) {unknown}; valid tasks: {', '.join(valid)}")
    return selected
