"""Dataset loading: JSONL validation, local copies of published benchmarks, the spec dispatcher."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfold.evaluate.data import loaders
from kvfold.evaluate.data.loaders import (
    LONGBENCH_TASKS,
    load_dataset_spec,
    load_jsonl,
    load_longbench,
    load_ruler_official,
    load_xsum,
    truncate_middle,
)
from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.evaluate.scoring.metrics import score_sample, score_sample_metrics


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps ``datasets``' cache of the tiny local copies inside the test's folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --- bring-your-own JSONL ------------------------------------------------------------------------

GOOD = {"context": "The sky is blue.", "question": "\nWhat colour is the sky?", "answers": ["blue"]}


def test_load_jsonl_defaults_and_optional_fields(tmp_path: Path) -> None:
    path = _write_jsonl(
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
    path = _write_jsonl(tmp_path / "data.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(ValueError, match=rf"data\.jsonl line 3: {message}"):
        load_jsonl(path)


def test_load_jsonl_empty_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no samples"):
        load_jsonl(_write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "absent.jsonl")


# --- LongBench -----------------------------------------------------------------------------------


def _longbench_row(task: str, i: int, **extra: Any) -> dict[str, Any]:
    return {
        "input": f"question {i}?",
        "context": f"document {i} of {task}",
        "answers": [f"answer {i}"],
        "length": 4,
        "dataset": task,
        "language": "en",
        "all_classes": None,
        "_id": f"{task}-{i}",
        **extra,
    }


@pytest.fixture
def longbench_dir(tmp_path: Path) -> Path:
    """A tiny local copy in LongBench's zip layout (``data/{task}.jsonl``)."""
    root = tmp_path / "longbench"
    for task in ("qasper", "passage_count", "lcc", "repobench-p"):
        _write_jsonl(root / "data" / f"{task}.jsonl", [_longbench_row(task, i) for i in range(3)])
    classes = ["Location", "Human being", "Entity"]
    _write_jsonl(
        root / "data" / "trec.jsonl",
        [_longbench_row("trec", 0, answers=["Human being"], all_classes=classes)],
    )
    return root


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
        spec = loaders._LONGBENCH[task]
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
        return [_longbench_row(name, 0)]

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


def test_truncate_middle_by_hand() -> None:
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError, match="positive"):
        truncate_middle([1], 0)


def test_longbench_truncation_keeps_head_and_tail_of_the_prompt(tmp_path: Path, word_tokenizer) -> None:
    words = " ".join(f"w{i}" for i in range(500))
    _write_jsonl(tmp_path / "lb" / "qasper.jsonl", [_longbench_row("qasper", 0, context=words)])
    (full,) = load_longbench(["qasper"], tmp_path / "lb")
    (cut,) = load_longbench(["qasper"], tmp_path / "lb", tokenizer=word_tokenizer, max_length=200)
    prompt_words = (full.context + full.question).split()
    kept = (cut.context + cut.question).split()
    assert len(prompt_words) > 200 and len(kept) == 200
    assert kept == prompt_words[:100] + prompt_words[-100:]  # LongBench: first and last halves
    assert cut.question == full.question


# --- XSum ----------------------------------------------------------------------------------------


def test_xsum_local_file_and_folder(tmp_path: Path) -> None:
    rows = [{"document": f"Article {i} text.", "summary": f"Summary {i}.", "id": str(i)} for i in range(3)]
    file = _write_jsonl(tmp_path / "xsum" / "test.jsonl", rows)
    from_file = load_xsum(file, max_samples=2)
    from_folder = load_xsum(tmp_path / "xsum")
    assert from_file == from_folder[:2] and len(from_folder) == 3
    sample = from_file[1]
    assert sample.context.endswith("Article 1 text.") and sample.answers == ("Summary 1.",)
    assert (sample.task, sample.metric, sample.extra_metrics, sample.sample_id) == (
        "xsum",
        "rouge_l",
        ("rouge_1", "rouge_2"),
        "1",
    )
    assert set(score_sample_metrics(sample, "Summary 1.")) == {"rouge_l", "rouge_1", "rouge_2"}


def test_xsum_hub_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path: str, name: str | None = None, **kwargs: Any) -> list[dict[str, str]]:
        calls.append((path, name, kwargs["split"]))
        return [{"document": "d", "summary": "s", "id": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(load_xsum()) == 1 and calls == [("EdinburghNLP/xsum", None, "test")]


def test_missing_datasets_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = _write_jsonl(tmp_path / "x.jsonl", [{"document": "d", "summary": "s", "id": "1"}])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'kvfold\[datasets\]'"):
        load_xsum(file)


# --- RULER official files ------------------------------------------------------------------------


def _ruler_niah_row(i: int) -> dict[str, Any]:
    prompt = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the numbers afterwards.\nThe grass is green. One of the special magic numbers for "
        f"key-{i} is: 100{i}. The sky is blue.\nWhat are all the special magic numbers for key-{i} mentioned "
        "in the provided text?"
    )
    prefix = f" Answer: The special magic numbers for key-{i} mentioned in the provided text are"
    return {"index": i, "input": prompt, "outputs": [f"100{i}"], "length": 80, "answer_prefix": prefix}


def _ruler_qa_row() -> dict[str, Any]:
    instruction = (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    )
    prompt = (
        f"{instruction}\n\nThe following are given documents.\n\nDocument 1:\nParis is in France.\n\n"
        f"{instruction}\n\nQuestion: Where is Paris?"
    )
    return {"index": 0, "input": prompt, "outputs": ["France"], "length": 40, "answer_prefix": " Answer:"}


@pytest.fixture
def ruler_dir(tmp_path: Path) -> Path:
    """A tiny copy in the layout RULER's prepare script writes: ``{task}/validation.jsonl``."""
    root = tmp_path / "ruler"
    _write_jsonl(root / "niah_single_1" / "validation.jsonl", [_ruler_niah_row(i) for i in range(3)])
    _write_jsonl(root / "qa_1" / "validation.jsonl", [_ruler_qa_row()])
    return root


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
    (sample,) = load_ruler_official(_write_jsonl(tmp_path / "kv" / "vt.jsonl", [row]))
    assert (sample.context, sample.question, sample.task, sample.max_new_tokens) == ("C", "\nQ", "vt", 30)
    with pytest.raises(FileNotFoundError, match="cwe"):
        load_ruler_official(ruler_dir, tasks=["cwe"])


def test_ruler_official_without_a_marker_is_a_clear_error(tmp_path: Path) -> None:
    file = _write_jsonl(tmp_path / "odd.jsonl", [{"input": "no question here", "outputs": ["x"]}])
    with pytest.raises(ValueError, match="cannot find where the question starts"):
        load_ruler_official(file)
    (sample,) = load_ruler_official(file, question_marker=" question")
    assert (sample.context, sample.question) == ("no", " question here")


# --- spec dispatcher -----------------------------------------------------------------------------


def test_spec_forms(tmp_path: Path, word_tokenizer, longbench_dir: Path, ruler_dir: Path) -> None:
    ruler = load_dataset_spec("ruler:niah_single_1,vt", word_tokenizer, length=600, samples=2)
    assert [s.task for s in ruler] == ["niah_single_1"] * 2 + ["vt"] * 2
    from kvfold.evaluate.data.ruler import HEADLINE_TASKS, RULER_TASKS

    headline = load_dataset_spec("ruler", word_tokenizer, length=600, samples=1)
    assert list(dict.fromkeys(s.task for s in headline)) == list(HEADLINE_TASKS)
    assert len({s.context for s in headline}) == len(HEADLINE_TASKS)  # one context a task
    everything = load_dataset_spec("ruler:all", word_tokenizer, length=600, samples=1)
    assert list(dict.fromkeys(s.task for s in everything)) == list(RULER_TASKS)
    jsonl = _write_jsonl(tmp_path / "own.jsonl", [GOOD, GOOD, GOOD])
    assert len(load_dataset_spec(str(jsonl), samples=2)) == 2
    assert [s.task for s in load_dataset_spec(f"longbench:qasper,trec@{longbench_dir}")] == ["qasper"] * 3 + ["trec"]
    xsum = _write_jsonl(tmp_path / "xsum.jsonl", [{"document": "d", "summary": "s", "id": "1"}])
    assert load_dataset_spec(f"xsum@{xsum}")[0].task == "xsum"
    assert len(load_dataset_spec(f"ruler-official:qa_1@{ruler_dir}")) == 1


def test_spec_errors(word_tokenizer) -> None:
    with pytest.raises(ValueError, match="needs the model's tokenizer and a length"):
        load_dataset_spec("ruler")
    with pytest.raises(ValueError, match=r"unknown dataset spec 'squad'; valid forms: ruler, ruler:TASK1,TASK2"):
        load_dataset_spec("squad")
    with pytest.raises(ValueError, match="unknown RULER task"):
        load_dataset_spec("ruler:nope", word_tokenizer, length=600)


def test_longbench_truncation_with_the_real_tokenizer(tmp_path: Path, smollm_tokenizer) -> None:
    from kvfold.evaluate.data.ruler import count_tokens, load_haystack

    _write_jsonl(tmp_path / "lb" / "narrativeqa.jsonl", [_longbench_row("narrativeqa", 0, context=load_haystack())])
    (cut,) = load_longbench(["narrativeqa"], tmp_path / "lb", tokenizer=smollm_tokenizer, max_length=1000)
    total = count_tokens(smollm_tokenizer, cut.context) + count_tokens(smollm_tokenizer, cut.question)
    assert 990 <= total <= 1002  # re-encoding the decoded halves may merge or split a token at the cut
    assert cut.context.startswith("You are given a story") and cut.context.endswith(load_haystack()[-60:])
