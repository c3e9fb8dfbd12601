"""Finished eval runs read back and merged: one run keeps its records, several are aggregated together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfold.evaluate.running.results import merge_runs, read_run
from kvfold.evaluate.scoring.records import aggregate

CONFIG = {"model": "tiny", "dataset": "ruler", "length": 2048, "seed": 0}


def _row(method: str, sample: int, score: float, *, context: str | None = None) -> dict:
    return {"sample_id": f"t/{sample}", "context_id": context or f"c{sample}", "task": "t", "haystack": "noise",
            "method": method, "budget": 1.0 if method == "full" else 0.5, "query_aware": False, "score": score,
            "answers": ["x"], "kv_bytes": 1 if method == "full" else 0.5, "kv_bytes_full": 1,
            "prefill_seconds": 2.0, "compress_seconds": 0.5}  # fmt: skip


def _write_run(folder: Path, rows: list[dict], *, finished: bool = True, config: dict = CONFIG) -> Path:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(config))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (folder / "results.json").write_text(json.dumps({"model": "tiny", "records": aggregate(rows)}))
    return folder


FULL = [_row("full", i, 100.0) for i in range(4)]
SNAPKV = [_row("snapkv", i, s) for i, s in enumerate([100.0, 0.0, 100.0, 100.0])]
KVZIP = [_row("kvzip", i, s) for i, s in enumerate([100.0, 100.0, 0.0, 0.0])]


def test_one_finished_run_keeps_the_records_it_wrote(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "a", FULL + SNAPKV)
    written = json.loads((run / "results.json").read_text())["records"]
    records, config = merge_runs([read_run(run)])
    assert records == written and config == CONFIG


def test_runs_merged_give_each_method_its_retention_against_the_full_cache_of_another(tmp_path: Path) -> None:
    a = read_run(_write_run(tmp_path / "a", FULL + SNAPKV))
    b = read_run(_write_run(tmp_path / "b", KVZIP + FULL))  # full again: the first run's answers are kept
    assert {r["method"]: r["retention"] for r in b.records if r["task"] == "t"}["kvzip"] == 0.5
    records, config = merge_runs([a, b])
    assert [r["method"] for r in records if r["task"] == "t"] == ["full", "snapkv", "kvzip"]
    assert records == aggregate(FULL + SNAPKV + KVZIP) and config == CONFIG
    alone = merge_runs([read_run(_write_run(tmp_path / "c", KVZIP))])[0]
    assert next(r for r in alone if r["task"] == "t")["retention"] is None  # no full cache in that run


def test_an_unfinished_run_is_aggregated_from_its_predictions_and_left_as_it_is(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "a", FULL + SNAPKV, finished=False)
    with (run / "predictions.jsonl").open("a") as f:
        f.write('{"sample_id": "t/9", "meth')  # a torn last line
    before = (run / "predictions.jsonl").read_text()
    records, _ = merge_runs([read_run(run)])
    assert records == aggregate(FULL + SNAPKV)
    assert (run / "predictions.jsonl").read_text() == before


def test_runs_on_other_samples_or_configurations_are_refused(tmp_path: Path) -> None:
    a = read_run(_write_run(tmp_path / "a", FULL))
    other_context = read_run(_write_run(tmp_path / "b", [_row("kvzip", 0, 100.0, context="elsewhere")]))
    with pytest.raises(ValueError, match="sample 't/0' .* not on the same samples"):
        merge_runs([a, other_context])
    other_seed = read_run(_write_run(tmp_path / "c", KVZIP, config={**CONFIG, "seed": 1}))
    with pytest.raises(ValueError, match=r"another configuration than .* \(seed: 0 → 1\)"):
        merge_runs([a, other_seed])
    with pytest.raises(ValueError, match="holds no predictions.jsonl"):
        read_run(tmp_path)
    with pytest.raises(ValueError, match="at least one run"):
        merge_runs([])


def _fidelity_row(method: str, sample: int, error: float) -> dict:
    return {"sample_id": f"t/{sample}", "task": "t", "method": method, "budget": 1.0 if method == "full" else 0.5,
            "kv_ratio": 1.0 if method == "full" else 0.5, "rel_error": error, "block_error": error / 2,
            "nll_delta": error / 10, "kl": error / 100, "nll_full": 2.0, "per_layer": [error, error],
            "block_per_layer": [error / 2, error / 2]}  # fmt: skip


def test_fidelity_runs_are_read_and_merged_as_well(tmp_path: Path) -> None:
    from kvfold.evaluate.running.fidelity import aggregate_fidelity

    full = [_fidelity_row("full", i, 0.0) for i in range(2)]
    snapkv = [_fidelity_row("snapkv", i, 0.1 * (i + 1)) for i in range(2)]
    folders = []
    for name, rows in (("a", full), ("b", snapkv)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "run.json").write_text(json.dumps({**CONFIG, "continuation": "answer"}))
        (folder / "fidelity_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        folders.append(folder)
    a, b = (read_run(f) for f in folders)
    assert a.kind.name == "fidelity" and a.records is None
    records, config = merge_runs([a, b])
    assert records == aggregate_fidelity(full + snapkv) and config["continuation"] == "answer"
    assert records[1]["rel_error"] == pytest.approx(0.15)
    eval_run = read_run(_write_run(tmp_path / "eval", FULL))
    with pytest.raises(ValueError, match="written by kvfold eval, .* by kvfold fidelity: only runs of one kind"):
        merge_runs([a, eval_run])
