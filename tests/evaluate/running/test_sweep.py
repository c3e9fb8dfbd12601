"""What every sweep shares: its (method, budget) runs, sample keys, resuming from the rows file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvfold.evaluate import Sample
from kvfold.evaluate.running.sweep import (
    SweepInterrupted,
    config_changes,
    open_run,
    plan_runs,
    read_predictions,
    sample_keys,
)
from kvfold.runtime.files import OutputError


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
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match="rows.jsonl line 2 is not a prediction row"):
        read_predictions(path)
    assert path.read_text() == '{"a": 1}\nnot json\n{"a": 2}\n'  # nothing changed


def _open(out: Path, seed: int = 0):
    return open_run(out, {"seed": seed}, "rows.jsonl", lambda row: row["k"])


def test_open_run_checks_the_configuration_and_reads_back_the_rows(tmp_path: Path) -> None:
    with open_run(None, {"seed": 0}, "rows.jsonl", lambda row: row["k"]) as opened:
        assert opened == (None, None, {})
    with _open(tmp_path / "run") as (out, path, done):
        assert done == {} and json.loads((out / "run.json").read_text()) == {"seed": 0}
        assert (out / ".kvfold.lock").read_text() == f"{os.getpid()}\n"  # held while the run is open
    assert not (out / ".kvfold.lock").exists()
    path.write_text(json.dumps({"k": "x", "v": 1}) + "\n" + json.dumps({"k": "x", "v": 2}) + "\n")
    with _open(out) as opened:
        assert opened[2] == {"x": {"k": "x", "v": 2}}
    with pytest.raises(ValueError, match=r"another configuration \(seed: 0 → 1\)"), _open(out, seed=1):
        pass
    assert config_changes({"a": 1, "b": 2}, {"a": 1, "c": 3}) == ["b: 2 → None", "c: None → 3"]


def test_open_run_refuses_a_second_writer_and_counts_what_ctrl_c_keeps(tmp_path: Path) -> None:
    with _open(tmp_path / "run") as (out, path, done):
        busy = rf"{out} is in use by another kvfold \(pid {os.getpid()}\)"
        with pytest.raises(OutputError, match=busy), _open(out):
            pass
    path.write_text(json.dumps({"k": "x"}) + "\n")
    kept = r"interrupted; 1 finished answers kept in .*rows.jsonl: run the same command again to resume"
    with pytest.raises(SweepInterrupted, match=kept), _open(out):
        raise KeyboardInterrupt
    path.write_text(json.dumps({"k": "x"}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl line 2 is not a prediction row \(no 'k'\)"), _open(out):
        pass
    (out / "run.json").write_text("{")
    with pytest.raises(ValueError, match=r"run.json is not valid JSON"), _open(out):
        pass
