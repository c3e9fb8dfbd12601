"""XSum: local files and folders, the hub call, and its three ROUGE scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfold.evaluate.data.xsum import load_xsum
from kvfold.evaluate.scoring.metrics import score_sample_metrics
from tests.evaluate.data.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_xsum_local_file_and_folder(tmp_path: Path) -> None:
    rows = [{"document": f"Article {i} text.", "summary": f"Summary {i}.", "id": str(i)} for i in range(3)]
    file = write_jsonl(tmp_path / "xsum" / "test.jsonl", rows)
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
