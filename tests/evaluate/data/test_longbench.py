"""LongBench: the official prompts, metrics and output lengths; local copies, the hub, truncation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfold.evaluate.data.longbench import LONGBENCH, LONGBENCH_TASKS, load_longbench
from kvfold.evaluate.data.text import count_tokens, load_haystack
from kvfold.evaluate.scoring.metrics import score_sample
from tests.evaluate.data.conftest import longbench_row, write_jsonl

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_longbench_task_table() -> None:
    assert LONGBENCH_TASKS == (
        "narrativeqa",
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "musique",
        "gov_report",
        "qmsum",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
        "repobench-p",
    )
    official = {  # LongBench's dataset2metric and dataset2maxlen
        "narrativeqa": ("qa_f1", 128),
        "qasper": ("qa_f1", 128),
        "multifieldqa_en": ("qa_f1", 64),
        "hotpotqa": ("qa_f1", 32),
        "2wikimqa": ("qa_f1", 32),
        "musique": ("qa_f1", 32),
        "gov_report": ("rouge_l", 512),
        "qmsum": ("rouge_l", 512),
        "multi_news": ("rouge_l", 512),
        "trec": ("classification_score", 64),
        "triviaqa": ("qa_f1", 32),
        "samsum": ("rouge_l", 128),
        "passage_count": ("count_score", 32),
        "passage_retrieval_en": ("retrieval_score", 32),
        "lcc": ("code_sim_score", 64),
        "repobench-p": ("code_sim_score", 64),
    }
    for task, (metric, max_new_tokens) in official.items():
        spec = LONGBENCH[task]
        assert (spec.metric, spec.max_new_tokens) == (metric, max_new_tokens), task


def test_longbench_local_copy_through_datasets(longbench_dir: Path) -> None:
    samples = load_longbench(["passage_count", "lcc", "repobench-p", "trec"], longbench_dir, max_samples=2)
    assert [s.task for s in samples] == ["passage_count"] * 2 + ["lcc"] * 2 + ["repobench-p"] * 2 + ["trec"]
    count, _, lcc, _, repobench, _, trec = samples
    assert count.context + count.question == (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
        "document 0 of passage_count\n\nPlease enter the final count of unique paragraphs after removing "
        "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\n"
        "The final answer is: "
    )
    assert count.context.endswith("document 0 of passage_count")
    assert (count.metric, count.max_new_tokens, count.sample_id, count.answers) == (
        "count_score",
        32,
        "passage_count-0",
        ("answer 0",),
    )
    assert lcc.context + lcc.question == "Please complete the code given below. \ndocument 0 of lccNext line of code:\n"
    assert repobench.question == "question 0?Next line of code:\n"
    assert not lcc.chat_template and count.chat_template
    assert trec.all_classes == ("Location", "Human being", "Entity") and trec.first_line_only
    assert score_sample(trec, "Human being\nQuestion: next example\nType: Location") == 100.0


def test_longbench_errors(longbench_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown LongBench task"):
        load_longbench(["lsht"], longbench_dir)
    with pytest.raises(FileNotFoundError, match="no gov_report.jsonl"):
        load_longbench(["gov_report"], longbench_dir)


def test_longbench_hub_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path: str, name: str | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append((path, name, kwargs["split"]))
        return [longbench_row(name, 0)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    samples = load_longbench(["hotpotqa", "samsum"])
    assert calls == [("THUDM/LongBench", "hotpotqa", "test"), ("THUDM/LongBench", "samsum", "test")]
    assert samples[0].question.endswith("Question: question 0?\nAnswer:")


def test_hub_failure_says_how_to_use_a_local_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="hub unreachable.*data.zip"):
        load_longbench(["qasper"])


def test_longbench_truncation_keeps_head_and_tail_of_the_prompt(tmp_path: Path, word_tokenizer) -> None:
    words = " ".join(f"w{i}" for i in range(500))
    write_jsonl(tmp_path / "lb" / "qasper.jsonl", [longbench_row("qasper", 0, context=words)])
    (full,) = load_longbench(["qasper"], tmp_path / "lb")
    (cut,) = load_longbench(["qasper"], tmp_path / "lb", tokenizer=word_tokenizer, max_length=200)
    prompt_words = (full.context + full.question).split()
    kept = (cut.context + cut.question).split()
    assert len(prompt_words) > 200 and len(kept) == 200
    assert kept == prompt_words[:100] + prompt_words[-100:]  # LongBench: first and last halves
    assert cut.question == full.question


def test_longbench_truncation_with_the_real_tokenizer(tmp_path: Path, smollm_tokenizer) -> None:
    write_jsonl(tmp_path / "lb" / "narrativeqa.jsonl", [longbench_row("narrativeqa", 0, context=load_haystack())])
    (cut,) = load_longbench(["narrativeqa"], tmp_path / "lb", tokenizer=smollm_tokenizer, max_length=1000)
    total = count_tokens(smollm_tokenizer, cut.context) + count_tokens(smollm_tokenizer, cut.question)
    assert 990 <= total <= 1002  # re-encoding the decoded halves may merge or split a token at the cut
    assert cut.context.startswith("You are given a story") and cut.context.endswith(load_haystack()[-60:])
