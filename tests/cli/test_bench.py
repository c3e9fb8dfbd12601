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
    assert main(["bench", "--lengths", "64", "--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvfold[ray]'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_bench_rejects_a_length_beyond_the_model_positions(tiny_dir, tmp_path, capsys):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_dir).max_position_embeddings
    args = ["bench", "--model", str(tiny_dir), "--lengths", str(limit + 1), "--batch", "1", "--out", str(tmp_path)]
    code = main(args)
    assert code == 2
    assert f"supports {limit} positions" in capsys.readouterr().err


def test_bench_cli_rejects_bad_input(capsys, tmp_path):
    assert main(["bench", "--methods", "nosuch", "--out", str(tmp_path)]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["bench", "--lengths", "0", "--out", str(tmp_path)]) == 2
    assert "--lengths takes comma-separated positive integers" in capsys.readouterr().err
