"""LongBench's English tasks with their official prompts, metrics and output lengths (:func:`load_longbench`).

LongBench: Bai et al., 2024, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding"; the prompts, metrics and output lengths are LongBench's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfold.evaluate.data.hub import first_rows, hub_rows, local_rows, maybe_truncate
from kvfold.evaluate.data.samples import Sample, check_tasks

__all__ = ["LONGBENCH", "LONGBENCH_TASKS", "LongBenchTask", "load_longbench"]


@dataclass(frozen=True)
class LongBenchTask:
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

LONGBENCH: dict[str, LongBenchTask] = {
    # "asconcisely" is in LongBench's official narrativeqa prompt; kept so that prompts match.
    "narrativeqa": LongBenchTask(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        f"question asconcisely as you can, {_NARRATIVE_RULES}\n\nStory: ",
        f"\n\nNow, answer the question based on the story asconcisely as you can, {_NARRATIVE_RULES}"
        "\n\nQuestion: {input}\n\nAnswer:",
        "qa_f1",
        128,
    ),
    "qasper": LongBenchTask(
        f"You are given a scientific article and a question. Answer the question as concisely as you can, "
        f"{_QASPER_RULES}\n\nArticle: ",
        f"\n\n Answer the question based on the above article as concisely as you can, {_QASPER_RULES}"
        "\n\nQuestion: {input}\n\nAnswer:",
        "qa_f1",
        128,
    ),
    "multifieldqa_en": LongBenchTask(
        "Read the following text and answer briefly.\n\n",
        "\n\nNow, answer the following question based on the above text, only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:",
        "qa_f1",
        64,
    ),
    "hotpotqa": LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "2wikimqa": LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "musique": LongBenchTask(*_MULTIDOC_QA, "qa_f1", 32),
    "gov_report": LongBenchTask(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n",
        "\n\nNow, write a one-page summary of the report.\n\nSummary:",
        "rouge_l",
        512,
    ),
    "qmsum": LongBenchTask(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n",
        "\n\nNow, answer the query based on the above meeting transcript in one or more sentences."
        "\n\nQuery: {input}\nAnswer:",
        "rouge_l",
        512,
    ),
    "multi_news": LongBenchTask(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n",
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        "rouge_l",
        512,
    ),
    "trec": LongBenchTask(
        "Please determine the type of the question below. Here are some examples of questions.\n\n",
        "\n{input}",
        "classification_score",
        64,
        first_line_only=True,
        chat_template=False,
    ),
    "triviaqa": LongBenchTask(
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n",
        "\n\n{input}",
        "qa_f1",
        32,
        first_line_only=True,
        chat_template=False,
    ),
    "samsum": LongBenchTask(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n",
        "\n\n{input}",
        "rouge_l",
        128,
        first_line_only=True,
        chat_template=False,
    ),
    "passage_count": LongBenchTask(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n",
        "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        "count_score",
        32,
    ),
    "passage_retrieval_en": LongBenchTask(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n",
        "\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the "
        'abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\n'
        "The answer is: ",
        "retrieval_score",
        32,
    ),
    "lcc": LongBenchTask(
        "Please complete the code given below. \n",
        "Next line of code:\n",
        "code_sim_score",
        64,
        chat_template=False,
    ),
    "repobench-p": LongBenchTask(
        "Please complete the code given below. \n",
        "{input}Next line of code:\n",
        "code_sim_score",
        64,
        chat_template=False,
    ),
}

LONGBENCH_TASKS: tuple[str, ...] = tuple(LONGBENCH)
"""The 16 English LongBench tasks."""

_HUB_HINT = (
    "Without hub access (or if this datasets version refuses the repo's loading script), download "
    "data.zip from the THUDM/LongBench dataset repo, unzip it and pass the folder holding {task}.jsonl "
    "as data_dir_or_repo."
)


def _longbench_sample(task: str, row: Mapping[str, Any], index: int) -> Sample:
    """A LongBench row as a sample with the task's official prompt."""
    spec = LONGBENCH[task]
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
    selected = check_tasks(tasks, LONGBENCH_TASKS, "LongBench")
    local = Path(data_dir_or_repo)
    samples: list[Sample] = []
    for task in selected:
        if local.is_dir():
            rows = local_rows(_longbench_file(local, task), cache_dir)
        else:
            rows = hub_rows(str(data_dir_or_repo), task, "test", cache_dir, _HUB_HINT)
        samples += [_longbench_sample(task, row, i) for i, row in enumerate(first_rows(rows, max_samples))]
    return maybe_truncate(samples, tokenizer, max_length)
