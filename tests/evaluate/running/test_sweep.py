"""What every sweep shares: its (method, budget) runs, sample keys, resuming from the rows file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfold.evaluate import Sample
from kvfold.evaluate.running.sweep import config_changes, open_run, plan_runs, read_predictions, sample_keys


def test_plan_runs() -> None:
    assert plan_runs(["full", "streamingllm", "full"], ["0.5", 0.2, 0.5]) == [
        ("full", plan_runs(["full"], [0.5])[0][1]),
        *[("streamingllm", b) for _, b in plan_runs(["streamingllm"], [0.5, 0.2])],
    ]
    assert [b.label() for _, b in plan_runs(["full"], [0.3])] == [1.0]
    assert [b.label() for _, b in plan_runs(["random"], ["128"])] == [128]
    with pytest.raises(ValueError, match="unknown method 'nosuch'"):
        plan_runs(["nosuch"], [0.5])
    with pytest.raises(ValueError, match="budget must be"):
        plan_runs(["streamingllm"], [1.5])


def test_sample_keys_are_unique() -> None:
    s = Sample("The context.", "\nA question?", ("answer",), "animals", sample_id="a1")
    other = Sample(s.context, s.question, s.answers, "t")
    assert sample_keys([s, s, other, other]) == ["a1", "a1#2", "t/2", "t/3"]


def test_a_torn_last_row_is_dropped_and_repaired_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    text = json.dumps({"a": 1}) + "\n" + '{"a": '
    path.write_text(text)
    assert read_predictions(path, repair=False) == [{"a": 1}] and path.read_text() == text
    assert read_predictions(path) == [{"a": 1}] and path.read_text() == json.dumps({"a": 1}) + "\n"


def test_open_run_checks_the_configuration_and_reads_back_the_rows(tmp_path: Path) -> None:
    assert open_run(None, {"seed": 0}, "rows.jsonl", lambda row: row["k"]) == (None, None, {})
    out, path, done = open_run(tmp_path / "run", {"seed": 0}, "rows.jsonl", lambda row: row["k"])
    assert done == {} and json.loads((out / "run.json").read_text()) == {"seed": 0}
    path.write_text(json.dumps({"k": "x", "v": 1}) + "\n" + json.dumps({"k": "x", "v": 2}) + "\n")
    assert open_run(out, {"seed": 0}, "rows.jsonl", lambda row: row["k"])[2] == {"x": {"k": "x", "v": 2}}
    with pytest.raises(ValueError, match=r"another configuration \(seed: 0 → 1\)"):
        open_run(out, {"seed": 1}, "rows.jsonl", lambda row: row["k"])
    assert config_changes({"a": 1, "b": 2}, {"a": 1, "c": 3}) == ["b: 2 → None", "c: None → 3"]
