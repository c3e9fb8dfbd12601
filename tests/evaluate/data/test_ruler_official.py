"""RULER's own prepared files: where the question starts, task folders, single files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfold.evaluate.data.ruler_official import load_ruler_official
from tests.evaluate.data.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_ruler_official_splits_context_and_question(ruler_dir: Path) -> None:
    samples = load_ruler_official(ruler_dir)
    assert [s.task for s in samples] == ["niah_single_1"] * 3 + ["qa_1"]
    niah, qa = samples[0], samples[3]
    assert niah.context.endswith("The sky is blue.")
    assert niah.question == "\nWhat are all the special magic numbers for key-0 mentioned in the provided text?"
    assert niah.answer_prefix == "Answer: The special magic numbers for key-0 mentioned in the provided text are"
    assert (niah.metric, niah.max_new_tokens, niah.length, niah.answers) == ("string_match_all", 128, 80, ("1000",))
    assert qa.context.endswith("Paris is in France.")
    assert qa.question.startswith("\n\nAnswer the question") and qa.question.endswith("Question: Where is Paris?")
    assert (qa.metric, qa.max_new_tokens) == ("string_match_part", 32)


def test_ruler_official_single_file_task_filter_and_fields(ruler_dir: Path, tmp_path: Path) -> None:
    assert [s.task for s in load_ruler_official(ruler_dir / "qa_1" / "validation.jsonl")] == ["qa_1"]
    assert len(load_ruler_official(ruler_dir, tasks=["niah_single_1"], max_samples=2)) == 2
    row = {"context": "C", "question": "\nQ", "outputs": ["a"], "task": "vt", "index": 5}
    (sample,) = load_ruler_official(write_jsonl(tmp_path / "kv" / "vt.jsonl", [row]))
    assert (sample.context, sample.question, sample.task, sample.max_new_tokens) == ("C", "\nQ", "vt", 30)
    with pytest.raises(FileNotFoundError, match="cwe"):
        load_ruler_official(ruler_dir, tasks=["cwe"])


def test_ruler_official_without_a_marker_is_a_clear_error(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "odd.jsonl", [{"input": "no question here", "outputs": ["x"]}])
    with pytest.raises(ValueError, match="cannot find where the question starts"):
        load_ruler_official(file)
    (sample,) = load_ruler_official(file, question_marker=" question")
    assert (sample.context, sample.question) == ("no", " question here")
