"""``kvfold mergemap`` and ``kvfold merged-entries``: files, printed lines, one-line errors (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvfold
import kvfold.runtime.models
from kvfold.cli.main import main
from tests.conftest import make_tiny_model
from tests.evaluate.conftest import CharTokenizer

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    specs: list[str] = []

    def load(spec: str, **kwargs):
        specs.append(spec)
        return kvfold.enable(make_tiny_model("llama", max_position_embeddings=2048)), CharTokenizer()

    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    return specs


def test_mergemap_cli(capsys, loads, tmp_path: Path):
    context = tmp_path / "context.txt"
    context.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    argv = [
        "mergemap",
        "--model",
        "tiny",
        "--context-file",
        str(context),
        "--methods",
        "snapkv[window=8],snapkv[window=8]+d2o_merge",
        "--budget",
        "0.3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0 and loads == ["tiny"]
    stdout = capsys.readouterr().out
    assert "snapkv[window=8]+d2o_merge" in stdout and "gini" in stdout
    assert {p.name for p in out.iterdir()} == {"mergemap.json", "mergemap.md", "mergemap.png", "carrier_load.png"}
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"context": TEXT, "question": "?", "answers": ["fox"]}) + "\n", encoding="utf-8")
    assert (
        main(
            [
                "mergemap",
                "--dataset",
                str(data),
                "--methods",
                "snapkv[window=8]+cam",
                "--budget",
                "0.3",
                "--head",
                "1",
                "--out",
                str(tmp_path / "jsonl"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main(["mergemap", "--context-file", str(tmp_path / "nope.txt"), "--methods", "snapkv", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "context file not found" in err and len(err.strip().splitlines()) == 1
    code = main(["mergemap", "--context-file", str(context), "--methods", "nosuch", "--out", str(out)])
    assert code == 2 and "unknown method 'nosuch'" in capsys.readouterr().err


def test_merged_entries_cli(capsys, loads) -> None:
    argv = "merged-entries --model tiny --task vt --length 700 --budget 0.3 --base snapkv --methods snapkv+cam"
    assert main(argv.split()) == 0 and loads == ["tiny"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("vt #0: ") and lines[1].startswith("snapkv: answers ")
    assert [line.split()[1] for line in lines[2:6]] == ["needle", "sink", "tail", "other"]
    assert lines[6].startswith("  snapkv+cam: answers ")
    for argv, message in (
        ("--task nosuch --base snapkv --methods snapkv+cam", "no RULER task"),
        ("--task vt --base snapkv --methods nosuch", "unknown method 'nosuch'"),
        ("--task vt --base snapkv,tova --methods snapkv+cam", "--base takes one method spec"),
    ):
        assert main(["merged-entries", *argv.split()]) == 2 and message in capsys.readouterr().err
    assert loads == ["tiny"]  # refused before the model was loaded
