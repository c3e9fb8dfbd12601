"""The command line's dataset specs (``load_dataset_spec``): every form, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfold.evaluate.data.loaders import load_dataset_spec
from kvfold.evaluate.data.ruler import HEADLINE_TASKS, RULER_TASKS
from tests.evaluate.data.conftest import GOOD, write_jsonl

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_spec_forms(tmp_path: Path, word_tokenizer, longbench_dir: Path, ruler_dir: Path) -> None:
    ruler = load_dataset_spec("ruler:niah_single_1,vt", word_tokenizer, length=600, samples=2)
    assert [s.task for s in ruler] == ["niah_single_1"] * 2 + ["vt"] * 2
    headline = load_dataset_spec("ruler", word_tokenizer, length=600, samples=1)
    assert list(dict.fromkeys(s.task for s in headline)) == list(HEADLINE_TASKS)
    assert len({s.context for s in headline}) == len(HEADLINE_TASKS)  # one context a task
    everything = load_dataset_spec("ruler:all", word_tokenizer, length=600, samples=1)
    assert list(dict.fromkeys(s.task for s in everything)) == list(RULER_TASKS)
    jsonl = write_jsonl(tmp_path / "own.jsonl", [GOOD, GOOD, GOOD])
    assert len(load_dataset_spec(str(jsonl), samples=2)) == 2
    assert [s.task for s in load_dataset_spec(f"longbench:qasper,trec@{longbench_dir}")] == ["qasper"] * 3 + ["trec"]
    xsum = write_jsonl(tmp_path / "xsum.jsonl", [{"document": "d", "summary": "s", "id": "1"}])
    assert load_dataset_spec(f"xsum@{xsum}")[0].task == "xsum"
    assert len(load_dataset_spec(f"ruler-official:qa_1@{ruler_dir}")) == 1


def test_spec_errors(word_tokenizer) -> None:
    with pytest.raises(ValueError, match="needs the model's tokenizer and a length"):
        load_dataset_spec("ruler")
    with pytest.raises(ValueError, match=r"unknown dataset spec 'squad'; valid forms: ruler, ruler:TASK1,TASK2"):
        load_dataset_spec("squad")
    with pytest.raises(ValueError, match="unknown RULER task"):
        load_dataset_spec("ruler:nope", word_tokenizer, length=600)
