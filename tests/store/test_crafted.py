"""Crafted int4 cache files (checksum recomputed): ``kvfold ask`` refuses each in one line, exit 2, never a crash."""

from __future__ import annotations

import io

import pytest

from kvfold.cli.main import main
from tests.store.crafted import CRAFTED_INT4, craft, truncate_file


def _ask(capsys, monkeypatch, model_dir, cache) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2 w3\n"))
    code = main(["ask", "--cache", str(cache), "--model", str(model_dir), "--new-tokens", "2"])
    out, err = capsys.readouterr()
    return code, out, err


def _refusal(err: str) -> str:
    """The one line of a refusal: stderr's last line, the only one that says ``error``, no traceback
    (the command's announcement and its progress bar may come before it)."""
    lines = err.rstrip("\n").split("\n")
    last = lines[-1]
    ok = last.startswith("kvfold ask: error: ") and not any("error" in line.lower() for line in lines[:-1])
    return last if ok and "Traceback" not in err else ""


def test_the_untouched_file_answers(int4_file, tiny_model_dir, capsys, monkeypatch):
    code, out, err = _ask(capsys, monkeypatch, tiny_model_dir, int4_file)
    assert code == 0, err
    assert out.strip()


@pytest.mark.parametrize("case", CRAFTED_INT4, ids=[case[0] for case in CRAFTED_INT4])
def test_a_crafted_file_is_refused_in_one_line(case, int4_file, tiny_model_dir, tmp_path, capsys, monkeypatch):
    name, edit_tensors, edit_header, words = case
    bad = craft(int4_file, tmp_path / "bad.kvc", tensors=edit_tensors, header=edit_header)
    code, out, err = _ask(capsys, monkeypatch, tiny_model_dir, bad)
    assert code == 2, (name, err)
    assert _refusal(err) and words in _refusal(err), err
    assert out == ""


@pytest.mark.parametrize("keep", [4, 40, -100, -1])
def test_a_truncated_file_is_refused_in_one_line(keep, int4_file, tiny_model_dir, tmp_path, capsys, monkeypatch):
    size = int4_file.stat().st_size
    bad = truncate_file(int4_file, tmp_path / "cut.kvc", keep % size)
    code, _, err = _ask(capsys, monkeypatch, tiny_model_dir, bad)
    assert code == 2 and "truncated" in _refusal(err), err
