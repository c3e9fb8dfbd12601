"""Fixtures of the data tests: small local copies of published benchmarks, in their own layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps ``datasets``' cache of the tiny local copies inside the test's folder (skips without ``datasets``)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows (objects, or lines as they are) written one a line; the folders are made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


GOOD = {"context": "The sky is blue.", "question": "\nWhat colour is the sky?", "answers": ["blue"]}
"""A valid bring-your-own line."""


def longbench_row(task: str, i: int, **extra: Any) -> dict[str, Any]:
    """A row in LongBench's layout."""
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
        write_jsonl(root / "data" / f"{task}.jsonl", [longbench_row(task, i) for i in range(3)])
    classes = ["Location", "Human being", "Entity"]
    write_jsonl(
        root / "data" / "trec.jsonl",
        [longbench_row("trec", 0, answers=["Human being"], all_classes=classes)],
    )
    return root


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
    write_jsonl(root / "niah_single_1" / "validation.jsonl", [_ruler_niah_row(i) for i in range(3)])
    write_jsonl(root / "qa_1" / "validation.jsonl", [_ruler_qa_row()])
    return root
