"""The documents of the kvfold tiny tasks, read next to this file (so the tasks run from any directory)."""

import json
from pathlib import Path

import datasets


def load(**_: object) -> datasets.DatasetDict:
    """lm-eval's ``custom_dataset`` hook (it passes model_args and metadata, unused here)."""
    path = Path(__file__).with_name("kvfold_tiny.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def contains_answer(doc: dict, results: list[str]) -> dict[str, float]:
    """1 when the generated text names the right city (a small model wraps it in words: "The answer is: Oslo")."""
    return {"contains": float(doc["choices"][doc["answer"]].lower() in results[0].lower())}
