"""Result records and a PNG check shared by the reporting tests."""

from __future__ import annotations

from pathlib import Path

from kvfold.evaluate.scoring.records import aggregate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records_of(budgets=(0.5, 0.2)) -> list[dict]:
    predictions = []
    for method, run_budgets in (("full", (1.0,)), ("streamingllm", budgets), ("streamingllm[sinks=8]", budgets)):
        for budget in run_budgets:
            for task, score in (("niah_single_1", 100.0), ("vt", 40.0)):
                predictions.append(
                    {
                        "method": method,
                        "budget": budget,
                        "task": task,
                        "sample_id": f"{task}/0",
                        "query_aware": False,
                        "score": score * (budget if isinstance(budget, float) else 0.5),
                        "kv_bytes": 10,
                        "kv_bytes_full": 40,
                    }
                )
    return aggregate(predictions)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
