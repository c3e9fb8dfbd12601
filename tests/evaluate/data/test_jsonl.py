"""Bring-your-own JSONL: fields, defaults, and errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfold.evaluate.data.jsonl import load_jsonl
from kvfold.evaluate.data.samples import Sample, group_by_context
from tests.evaluate.data.conftest import GOOD, write_jsonl


def test_load_jsonl_defaults_and_optional_fields(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            GOOD,
            "",
            {
                **GOOD,
                "question": "\nAnd the grass?",
                "answers": ["green", "Green"],
                "answer_prefix": "Answer:",
                "max_new_tokens": 8,
                "task": "colours",
                "metric": "qa_f1",
                "id": 17,
                "extra_key": "ignored",
            },
        ],
    )
    first, second = load_jsonl(path)
    assert first == Sample(
        context="The sky is blue.",
        question="\nWhat colour is the sky?",
        answers=("blue",),
        task="mine",
        max_new_tokens=32,
        metric="string_match_all",
        sample_id="mine/1",
    )
    assert (second.task, second.metric, second.max_new_tokens, second.sample_id) == ("colours", "qa_f1", 8, "17")
    assert second.answers == ("green", "Green") and second.answer_prefix == "Answer:"
    # Samples that share a context are compressed once.
    assert [(c, len(g)) for c, g in group_by_context([first, second])] == [("The sky is blue.", 2)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"context": "x", "question": "q", "answers": ["a"]', r"invalid JSON"),
        ("[1, 2]", r"each line must be a JSON object, got list"),
        (json.dumps({"context": "x", "question": "q"}), r"missing required field\(s\) 'answers'"),
        (json.dumps({**GOOD, "answers": "blue"}), r"'answers' must be a list of strings, got str"),
        (json.dumps({**GOOD, "answers": ["blue", 3]}), r"'answers' must be a list of strings, got an item of type int"),
        (json.dumps({**GOOD, "answers": []}), r"'answers' must contain at least one string"),
        (json.dumps({**GOOD, "context": "  "}), r"'context' must be a non-empty string"),
        (json.dumps({**GOOD, "context": 5}), r"'context' must be a string, got int"),
        (json.dumps({**GOOD, "question": None}), r"'question' must be a string, got null"),
        (json.dumps({**GOOD, "max_new_tokens": 0}), r"'max_new_tokens' must be a positive integer, got 0"),
        (json.dumps({**GOOD, "max_new_tokens": "8"}), r"'max_new_tokens' must be a positive integer"),
        (json.dumps({**GOOD, "max_new_tokens": True}), r"'max_new_tokens' must be a positive integer"),
        (json.dumps({**GOOD, "metric": "bleu"}), r"unknown metric 'bleu'; valid metrics: .*qa_f1"),
        (json.dumps({**GOOD, "answer_prefix": 1}), r"'answer_prefix' must be a string, got int"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(ValueError, match=rf"data\.jsonl line 3: {message}"):
        load_jsonl(path)


def test_load_jsonl_empty_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no samples"):
        load_jsonl(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "absent.jsonl")
