"""The ``kvfold bench`` command line: what it refuses, in one clear line (the measurements:
tests/evaluate/bench/)."""

from __future__ import annotations

import sys

import pytest

from kvfold.cli.bench import COMMANDS
from kvfold.cli.main import SUBCOMMAND_MODULES, main
from tests.evaluate.bench.conftest import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_bench_is_a_subcommand_of_the_command_line():
    assert "kvfold.cli.bench" in SUBCOMMAND_MODULES and set(COMMANDS) == {"bench"}


def test_bench_ray_without_ray_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["bench", "--length", "64", "--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvfold[ray]'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_bench_rejects_a_length_beyond_the_model_positions(tiny_dir, tmp_path, capsys):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_dir).max_position_embeddings
    args = ["bench", "--model", str(tiny_dir), "--length", str(limit + 1), "--batch", "1", "--out", str(tmp_path)]
    code = main(args)
    assert code == 2
    assert f"supports {limit} positions" in capsys.readouterr().err


def test_bench_cli_rejects_bad_input(capsys, tmp_path):
    assert main(["bench", "--methods", "nosuch", "--out", str(tmp_path)]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["bench", "--length", "0", "--out", str(tmp_path)]) == 2
    assert "--length takes comma-separated positive integers" in capsys.readouterr().err


def test_report_reads_bench_folders_and_writes_their_tables(tiny_dir, tmp_path, capsys):
    """``kvfold report`` on two bench folders: one table (``full`` once), its lines, and with
    ``--out`` the merged ``bench.md`` and plots; another model's bench is refused in one line."""
    import json

    common = ["--model", str(tiny_dir), "--budgets", "0.25", "--length", "64", "--new-tokens", "2", "--quiet"]
    for name, method in (("a", "streamingllm"), ("b", "knorm")):
        assert main(["bench", *common, "--methods", method, "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--markdown"]) == 0
    table = capsys.readouterr().out
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert table.startswith("# kvfold bench") and rows == ["| method", "| full", "| knorm", "| streamingllm"]
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["full", "streamingllm", "knorm"] and "tok/s" in lines[1]
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "bench.md").read_text() == table
    assert (tmp_path / "merged" / "bench.png").stat().st_size > 0
    other = json.loads((tmp_path / "b" / "bench.json").read_text())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "bench.json").write_text(json.dumps(dict(other, model="another")))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "measured different models" in err and err.count("\n") == 1
