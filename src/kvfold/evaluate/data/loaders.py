"""Dataset loaders: bring-your-own JSONL, LongBench, RULER's official files and XSum.

All loaders return :class:`~kvfold.evaluate.data.samples.Sample` lists, and :func:`load_dataset_spec`
turns a command-line spec into one. Published benchmarks are read with the optional
``datasets`` package (``pip install 'kvfold[datasets]'``): from the hub with
``datasets.load_dataset(repo, config, split=...)``, or from a local copy of the same layout with
``datasets.load_dataset("json", data_files=...)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from kvfold.evaluate.data.ruler import HEADLINE_TASKS, RULER_MAX_NEW_TOKENS, RULER_TASKS, count_tokens, generate_ruler
from kvfold.evaluate.data.ruler import token_ids as _encode
from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.scoring.metrics import METRICS

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


# --- bring-your-own JSONL ------------------------------------------------------------------------

_REQUIRED_FIELDS = ("context", "answers")


def _type_name(value: Any) -> str:
    """JSON-ish name of a value's type for error messages."""
    return "null" if value is None else type(value).__name__


def _string_list(record: Mapping[str, Any], field: str, where: str) -> tuple[str, ...]:
    """A field that must be a list of strings."""
    value = record[field]
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} must be a list of strings, got {_type_name(value)}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"{where}: {field!r} must be a list of strings, got an item of type {_type_name(item)}")
    return tuple(value)


def _optional_string(record: Mapping[str, Any], field: str, default: str, where: str) -> str:
    """An optional field that must be a string when present."""
    value = record.get(field, default)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field!r} must be a string, got {_type_name(value)}")
    return value


def _questions(record: Mapping[str, Any], where: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(question, answers)`` pairs: one ``question`` with its ``answers`` list, or ``questions``
    (a list of strings) with ``answers`` as a list of answer lists, one per question."""
    if "questions" in record:
        if "question" in record:
            raise ValueError(f"{where}: give either 'question' or 'questions', not both")
        questions = _string_list(record, "questions", where)
        if not questions:
            raise ValueError(f"{where}: 'questions' must contain at least one string")
        answers = record["answers"]
        if not isinstance(answers, list) or len(answers) != len(questions):
            raise ValueError(
                f"{where}: with 'questions', 'answers' must be a list of {len(questions)} answer lists "
                f"(one per question), got {_type_name(answers)}"
                + (f" of {len(answers)}" if isinstance(answers, list) else "")
            )
        pairs = []
        for k, (question, refs) in enumerate(zip(questions, answers, strict=True)):
            refs = _string_list({"answers": refs}, "answers", f"{where} question {k + 1}")
            if not refs:
                raise ValueError(f"{where} question {k + 1}: its answer list must contain at least one string")
            pairs.append((question, refs))
        return pairs
    if "question" not in record:
        raise ValueError(f"{where}: missing required field 'question' (or 'questions')")
    answers = _string_list(record, "answers", where)
    if not answers:
        raise ValueError(f"{where}: 'answers' must contain at least one string")
    return [(_optional_string(record, "question", "", where), answers)]


def _samples_from_record(record: Any, where: str, default_task: str, line_number: int) -> list[Sample]:
    """Validates one JSONL record and builds its samples (one per question; they share the context)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {_type_name(record)}")
    missing = [field for field in _REQUIRED_FIELDS if field not in record]
    if missing:
        raise ValueError(f"{where}: missing required field(s) {', '.join(map(repr, missing))}")
    context = _optional_string(record, "context", "", where)
    if not context.strip():
        raise ValueError(f"{where}: 'context' must be a non-empty string")
    pairs = _questions(record, where)
    max_new_tokens = record.get("max_new_tokens", 32)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"{where}: 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
    metric = _optional_string(record, "metric", "string_match_all", where)
    if metric not in METRICS:
        raise ValueError(f"{where}: unknown metric {metric!r}; valid metrics: {', '.join(sorted(METRICS))}")
    task = _optional_string(record, "task", default_task, where) or default_task
    sample_id = str(record.get("sample_id", record.get("id", f"{task}/{line_number}")))
    haystack = record.get("haystack")
    if haystack is not None and haystack not in ("noise", "prose"):
        raise ValueError(f"{where}: 'haystack' must be \"noise\" or \"prose\", got {haystack!r}")
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
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            samples.extend(_samples_from_record(record, where, path.stem, line_number))
    if not samples:
        raise ValueError(f"{path}: no samples (the file is empty)")
    return samples


# --- shared helpers for published benchmarks -----------------------------------------------------


def _import_datasets() -> Any:
    """Imports the optional ``datasets`` package or says how to install it."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "loading published benchmarks needs the optional 'datasets' package: pip install 'kvfold[datasets]'"
        ) from exc
    return datasets


def _local_rows(file: Path, cache_dir: str | None) -> Any:
    """Rows of a local JSON Lines file, read through ``datasets``' JSON builder."""
    datasets = _import_datasets()
    return datasets.load_dataset("json", data_files=str(file), split="train", cache_dir=cache_dir)


def _hub_rows(repo: str, config: str | None, split: str, cache_dir: str | None, hint: str) -> Any:
    """Rows of a hub dataset; a failure is re-raised with how to use a local copy instead."""
    datasets = _import_datasets()
    try:
        return datasets.load_dataset(repo, config, split=split, cache_dir=cache_dir)
    except Exception as exc:
        raise RuntimeError(
            f"could not load {repo!r} (config {config!r}, split {split!r}) from the hub: {exc}. {hint}"
        ) from exc


def _first(rows: Iterable[Mapping[str, Any]], max_samples: int | None) -> list[Mapping[str, Any]]:
    """The first ``max_samples`` rows (all when ``None``)."""
    return list(rows if max_samples is None else islice(rows, max_samples))


def truncate_middle(token_ids: Sequence[int], max_len: int) -> list[int]:
    """LongBench's truncation: keep the first and the last tokens, drop the middle.

    Keeps ``max_len // 2`` tokens from the start and ``max_len - max_len // 2`` from the end, so the
    result has exactly ``max_len`` tokens (LongBench keeps ``max_len // 2`` at each end, one fewer
    for odd ``max_len``). Sequences no longer than ``max_len`` are returned unchanged.

    Args:
        token_ids: Token ids.
        max_len: Maximum number of tokens to keep; positive.

    Returns:
        The kept token ids.

    Example:
        >>> truncate_middle(list(range(10)), 5)
        [0, 1, 7, 8, 9]
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive; got {max_len}")
    ids = list(token_ids)
    if len(ids) <= max_len:
        return ids
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head) :]


def _truncate_context(tokenizer: Any, context: str, question: str, max_length: int) -> str:
    """Middle-truncates ``context`` so that the whole prompt ``context + question`` fits ``max_length``
    tokens, as LongBench truncates its prompt: the question stays inside the kept tail.

    The kept head and tail are decoded separately and joined, as LongBench does.
    """
    context_ids = _encode(tokenizer, context)
    question_tokens = count_tokens(tokenizer, question)
    if len(context_ids) + question_tokens <= max_length:
        return context
    head = max_length // 2
    if question_tokens > max_length - head:
        raise ValueError(f"max_length={max_length} is too small: the question alone takes {question_tokens} tokens")
    # truncate_middle(context + question) keeps `head` tokens and a tail that ends with the question;
    # the context's share of that tail is what precedes the question.
    tail = max_length - head - question_tokens
    kept_tail = context_ids[len(context_ids) - tail :] if tail else []
    decode = tokenizer.decode
    return decode(context_ids[:head], skip_special_tokens=True) + decode(kept_tail, skip_special_tokens=True)


# --- LongBench -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LongBenchTask:
    """A LongBench task: its official prompt split around the context, metric and output length."""

    before_context: str
    after_context: str  # may contain "{input}"
    metric: str
    max_new_tokens: int
    first_line_only: bool = False  # LongBench scores only the first line for few-shot tasks
    chat_template: bool = True  # LongBench does not chat-wrap few-shot and code prompts


_MULTIDOC_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n",
    "\n\nAnswer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {input}\nAnswer:",
)
_QASPER_RULES = (
    "using a single phrase or sentence if possible. If the question cannot be answered based on the "
    'information in the article, write "unanswerable". If the question is a yes/no question, answer '
    '"yes", "no", or "unanswerable". Do not provide any explanation.'
)
_NARRATIVE_RULES = "using a single phrase if possible. Do not provide any explanation."

_LONGBENCH: dict[str, _LongBenchTask] = {
    # "asconcisely" is in LongBench's official narrativeqa prompt; kept so that prompts match.
    "narrativeqa": _LongBenchTask(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        f"question asconcisely as you can, {_NARRATIVE_RULES}\n\nStory: ",
        f"\n\nNow, answer the question based on the story asconcisely as you can, {_NARRATIVE_RULES}"
        "\n\nQuestion: {input}\n\nAnswer:",
        "qa_f1",
        128,
    ),
    "qasper": _LongBenchTask(
        f"You are given a scientific article and a question. Answer the question as concisely as you can, "
        f"{_QASPER_RULES}\n\nArticle: ",
        f"\n\n Answer the question based on the above article as concisely as you can, {_QASPER_RULES}"
        "\n\nQuestion: {input}\n\nAnswer:",
        "qa_f1",
        128,
    ),
    "multifieldqa_en": _LongBenchTask(
        "Read the following text and answer briefly.\n\n",
        "\n\nNow, answer the following question based on the above text, only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:",
        "qa_f1",
        64,
    ),
    "hotpotqa": _LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "2wikimqa": _LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "musique": _LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "gov_report": _LongBenchTask(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n",
        "\n\nNow, write a one-page summary of the report.\n\nSummary:",
        "rouge_l",
        512,
    ),
    "qmsum": _LongBenchTask(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n",
        "\n\nNow, answer the query based on the above meeting transcript in one or more sentences."
        "\n\nQuery: {input}\nAnswer:",
        "rouge_l",
        512,
    ),
    "multi_news": _LongBenchTask(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n",
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        "rouge_l",
        512,
    ),
    "trec": _LongBenchTask(
        "Please determine the type of the question below. Here are some examples of questions.\n\n",
        "\n{input}",
        "classification_score",
        64,
        first_line_only=True,
        chat_template=False,
    ),
    "triviaqa": _LongBenchTask(
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n",
        "\n\n{input}",
        "qa_f1",
        32,
        first_line_only=True,
        chat_template=False,
    ),
    "samsum": _LongBenchTask(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n",
        "\n\n{input}",
        "rouge_l",
        128,
        first_line_only=True,
        chat_template=False,
    ),
    "passage_count": _LongBenchTask(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n",
        "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        "count_score",
        32,
    ),
    "passage_retrieval_en": _LongBenchTask(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n",
        "\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the "
        'abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\n'
        "The answer is: ",
        "retrieval_score",
        32,
    ),
    "lcc": _LongBenchTask(
        "Please complete the code given below. \n",
        "Next line of code:\n",
        "code_sim_score",
        64,
        chat_template=False,
    ),
    "repobench-p": _LongBenchTask(
        "Please complete the code given below. \n",
        "{input}Next line of code:\n",
        "code_sim_score",
        64,
        chat_template=False,
    ),
}

LONGBENCH_TASKS: tuple[str, ...] = tuple(_LONGBENCH)
"""The 16 English LongBench tasks."""

_LONGBENCH_HINT = (
    "Without hub access (or if this datasets version refuses the repo's loading script), download "
    "data.zip from the THUDM/LongBench dataset repo, unzip it and pass the folder holding {task}.jsonl "
    "as data_dir_or_repo."
)


def _longbench_sample(task: str, row: Mapping[str, Any], index: int) -> Sample:
    """A LongBench row as a sample with the task's official prompt."""
    spec = _LONGBENCH[task]
    return Sample(
        context=spec.before_context + row["context"],
        question=spec.after_context.replace("{input}", row.get("input") or ""),
        answers=tuple(row["answers"]),
        task=task,
        max_new_tokens=spec.max_new_tokens,
        metric=spec.metric,
        sample_id=str(row.get("_id") or f"{task}/{index}"),
        all_classes=tuple(row.get("all_classes") or ()),
        first_line_only=spec.first_line_only,
        chat_template=spec.chat_template,
    )


def _longbench_file(folder: Path, task: str) -> Path:
    """``{task}.jsonl`` in ``folder`` or in its ``data/`` subfolder (the layout of LongBench's zip)."""
    for candidate in (folder / f"{task}.jsonl", folder / "data" / f"{task}.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no {task}.jsonl in {folder} or {folder / 'data'}")


def _check_tasks(tasks: Sequence[str] | None, valid: Sequence[str], benchmark: str) -> tuple[str, ...]:
    """The requested task names (all when ``None``), validated."""
    selected = tuple(valid if tasks is None else tasks)
    unknown = [t for t in selected if t not in valid]
    if unknown:
        raise ValueError(f"unknown {benchmark} task(s) {unknown}; valid tasks: {', '.join(valid)}")
    return selected


def _maybe_truncate(samples: list[Sample], tokenizer: Any, max_length: int | None) -> list[Sample]:
    """Applies LongBench's middle truncation when a tokenizer and ``max_length`` are given."""
    if tokenizer is None or max_length is None:
        return samples
    truncated = []
    for s in samples:
        context = _truncate_context(tokenizer, s.context, s.question, max_length)
        truncated.append(s if context == s.context else replace(s, context=context))
    return truncated


def load_longbench(
    tasks: Sequence[str] | None = None,
    data_dir_or_repo: str | Path = "THUDM/LongBench",
    max_samples: int | None = None,
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    cache_dir: str | None = None,
) -> list[Sample]:
    """Loads LongBench's English tasks with their official prompts, metrics and output lengths.

    The official prompt of each task is split around the document: instruction and document go
    in ``context``, the rest of the prompt (question, "Answer:") in ``question``, so
    ``context + question`` is LongBench's prompt. ``trec``, ``triviaqa`` and ``samsum`` are scored on
    the prediction's first line, and ``trec``, ``triviaqa``, ``samsum``, ``lcc``, ``repobench-p``
    are marked ``chat_template=False``, as LongBench does.

    Args:
        tasks: Task names from :data:`LONGBENCH_TASKS`; all 16 when ``None``.
        data_dir_or_repo: A hub dataset repo (config per task, split ``"test"``) or a local folder
            holding ``{task}.jsonl`` files (or ``data/{task}.jsonl``, as in LongBench's zip).
        max_samples: At most this many samples per task.
        tokenizer: With ``max_length``, truncates each prompt to ``max_length`` tokens by dropping
            the middle of the context (LongBench's truncation); needs ``decode``.
        max_length: Prompt length limit in tokens, e.g. the model's context minus the output.
        cache_dir: ``datasets`` cache folder.

    Returns:
        The samples, task by task.

    Raises:
        ValueError: On an unknown task name.
        FileNotFoundError: If a local folder lacks a task's file.
        ImportError: If ``datasets`` is not installed.
        RuntimeError: If the hub load fails (the message says how to use a local copy).
    """
    selected = _check_tasks(tasks, LONGBENCH_TASKS, "LongBench")
    local = Path(data_dir_or_repo)
    samples: list[Sample] = []
    for task in selected:
        if local.is_dir():
            rows = _local_rows(_longbench_file(local, task), cache_dir)
        else:
            rows = _hub_rows(str(data_dir_or_repo), task, "test", cache_dir, _LONGBENCH_HINT)
        samples += [_longbench_sample(task, row, i) for i, row in enumerate(_first(rows, max_samples))]
    return _maybe_truncate(samples, tokenizer, max_length)


# --- XSum ----------------------------------------------------------------------------------------

XSUM_MAX_NEW_TOKENS = 64
_XSUM_INSTRUCTION = "Summarize the following news article in one sentence.\n\nArticle:\n"
_XSUM_QUESTION = "\n\nNow write a one-sentence summary of the article above.\n\nSummary:"


def load_xsum(
    path_or_repo: str | Path = "EdinburghNLP/xsum",
    split: str = "test",
    max_samples: int | None = None,
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    cache_dir: str | None = None,
) -> list[Sample]:
    """Loads XSum (one-sentence news summaries), scored by ROUGE-L with ROUGE-1/2 also reported.

    Args:
        path_or_repo: A hub dataset repo, a local ``.jsonl`` file or a folder holding
            ``{split}.jsonl``; rows have ``document``, ``summary`` and ``id``.
        split: Split to read.
        max_samples: At most this many samples.
        tokenizer: With ``max_length``, middle-truncates long articles (as for LongBench).
        max_length: Prompt length limit in tokens.
        cache_dir: ``datasets`` cache folder.

    Returns:
        Samples with ``metric="rouge_l"`` and ``extra_metrics=("rouge_1", "rouge_2")``.
    """
    local = Path(path_or_repo)
    if local.is_file():
        rows = _local_rows(local, cache_dir)
    elif local.is_dir():
        rows = _local_rows(local / f"{split}.jsonl", cache_dir)
    else:
        hint = "Pass a local .jsonl file (or a folder with {split}.jsonl) with document/summary/id fields."
        rows = _hub_rows(str(path_or_repo), None, split, cache_dir, hint)
    samples = [
        Sample(
            context=_XSUM_INSTRUCTION + row["document"],
            question=_XSUM_QUESTION,
            answers=(row["summary"],),
            task="xsum",
            max_new_tokens=XSUM_MAX_NEW_TOKENS,
            metric="rouge_l",
            sample_id=str(row.get("id") or f"xsum/{i}"),
            extra_metrics=("rouge_1", "rouge_2"),
        )
        for i, row in enumerate(_first(rows, max_samples))
    ]
    return _maybe_truncate(samples, tokenizer, max_length)


# --- RULER official files ------------------------------------------------------------------------

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
    raise ValueError(
        f"{where}: cannot find where the question starts (looked for {list(markers)}); "
        "add 'context' and 'question' fields or pass question_marker="
    )


def _ruler_answers(row: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """RULER's ``outputs`` (or ``answers``/``answer``) as a tuple of strings."""
    for field in ("outputs", "answers", "answer"):
        value = row.get(field)
        if value is not None:
            return (value,) if isinstance(value, str) else tuple(str(v) for v in value)
    raise ValueError(f"{where}: no 'outputs' (or 'answers') field")


def _ruler_official_sample(row: Mapping[str, Any], task: str, index: int, markers: Sequence[str]) -> Sample:
    """A row of RULER's prepared data as a sample."""
    task = str(row.get("task") or task)
    where = f"RULER {task} sample {index}"
    if row.get("context") is not None and row.get("question") is not None:
        context, question = row["context"], row["question"]
    elif isinstance(row.get("input"), str):
        context, question = _ruler_split(row["input"], markers, where)
    else:
        raise ValueError(f"{where}: needs an 'input' string (or 'context' and 'question' fields)")
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
        sources = [(task, _local_rows(file, cache_dir)) for task, file in files]
    else:
        hint = "Pass a local RULER file or a folder of {task}/validation.jsonl files instead."
        configs = list(tasks) if tasks is not None else [config]
        sources = [(c or "ruler", _hub_rows(str(path_or_repo), c, split, cache_dir, hint)) for c in configs]
    return [
        _ruler_official_sample(row, task, i, markers)
        for task, rows in sources
        for i, row in enumerate(_first(rows, max_samples))
    ]


# --- spec dispatcher -----------------------------------------------------------------------------

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
            raise ValueError("the 'ruler' dataset needs the model's tokenizer and a length in tokens")
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
    raise ValueError(f"unknown dataset spec {spec!r}; valid forms: {', '.join(_SPEC_FORMS)}")
