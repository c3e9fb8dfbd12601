"""``kvfold compress``, ``kvfold generate --cache``, ``kvfold ask`` and ``kvfold chat`` on a tiny local model."""

from __future__ import annotations

import io
import json

import pytest

from kvfold.cli.main import main
from tests.conftest import make_tiny_model
from tests.runtime.test_models import _write_tokenizer

CONTEXT = " ".join(f"w{(i * 7) % 96 + 1}" for i in range(160))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama").save_pretrained(path)
    _write_tokenizer(path)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def saved(tiny_dir, tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text(CONTEXT)
    out = tmp_path / "doc.kvc"
    code, stdout, err = run(
        capsys, "compress", "--model", str(tiny_dir), "--context-file", str(context),
        "--method", "snapkv", "--budget", "0.25", "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, err
    return out, json.loads(stdout), context


def test_compress_writes_a_file_of_the_budgets_size(saved):
    out, record, _ = saved
    assert out.is_file() and record["file_bytes"] == out.stat().st_size
    assert record["context_tokens"] >= 160
    assert 0.2 < record["file_ratio"] < 0.3  # budget 0.25 of the full cache, plus a small header


def test_generate_from_the_cache_equals_generate_with_the_prefill(saved, tiny_dir, capsys):
    out, _, context = saved
    args = ["--model", str(tiny_dir), "--question", "w3 w5 w7", "--new-tokens", "6", "--json"]
    code, stdout, err = run(capsys, "generate", "--cache", str(out), *args)
    assert code == 0, err
    from_file = json.loads(stdout)
    code, stdout, _ = run(
        capsys, "generate", "--context-file", str(context), "--method", "snapkv", "--budget", "0.25", *args
    )
    assert code == 0
    direct = json.loads(stdout)
    assert from_file["answer"] == direct["answer"]
    assert from_file["method"] == "snapkv" and from_file["budget"] == 0.25
    assert from_file["kv_bytes"] == direct["kv_bytes"] and "load_seconds" in from_file


def test_generate_with_a_cache_refuses_compression_flags(saved, tiny_dir, capsys):
    out, _, _ = saved
    code, _, err = run(
        capsys, "generate", "--cache", str(out), "--model", str(tiny_dir), "--question", "q", "--method", "h2o"
    )
    assert code == 2 and "do not apply with --cache" in err


def test_ask_answers_every_line_from_the_same_cache(saved, tiny_dir, capsys, monkeypatch, tmp_path):
    out, _, _ = saved
    questions = ["w1 w2", "", "w3 w4", "w1 w2"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(questions) + "\n"))
    code, stdout, err = run(capsys, "ask", "--cache", str(out), "--model", str(tiny_dir), "--new-tokens", "5")
    assert code == 0, err
    answers = stdout.splitlines()
    assert len(answers) == 3 and answers[0] == answers[2]  # a fresh copy for every question
    path = tmp_path / "questions.txt"
    path.write_text("w1 w2\nw3 w4\n")
    code, stdout, _ = run(
        capsys, "ask", "--cache", str(out), "--model", str(tiny_dir), "--questions", str(path),
        "--new-tokens", "5", "--json",
    )  # fmt: skip
    records = [json.loads(line) for line in stdout.splitlines()]
    assert [r["answer"] for r in records] == [answers[0], answers[1]]


def test_ask_errors_are_one_clear_line(saved, tiny_dir, capsys, tmp_path):
    out, _, _ = saved
    other = tmp_path / "other"
    make_tiny_model("llama", seed=3).save_pretrained(other)
    _write_tokenizer(other)
    code, _, err = run(capsys, "ask", "--cache", str(out), "--model", str(other), "--questions", str(out))
    assert code == 2 and "another model" in err and "Traceback" not in err
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(out.read_bytes()[:-10])
    code, _, err = run(capsys, "ask", "--cache", str(bad), "--model", str(tiny_dir))
    assert code == 2 and "truncated" in err
    code, _, err = run(capsys, "ask", "--cache", str(out), "--model", str(tiny_dir), "--dtype", "bfloat16")
    assert code == 2 and "--cache-dtype" in err


def test_chat_reads_piped_stdin_with_commands(saved, tiny_dir, tmp_path, capsys, monkeypatch):
    out, _, context = saved
    talk = tmp_path / "talk.kvc"
    lines = [f"w{i} w{i + 1} w{i + 2}" for i in range(1, 9)]
    script = "\n".join([*lines[:4], "/stats", f"/save {talk}", *lines[4:], "/stats", "/nonsense", "/quit", "w9"])
    monkeypatch.setattr("sys.stdin", io.StringIO(script + "\n"))
    code, stdout, err = run(
        capsys, "chat", "--model", str(tiny_dir), "--context-file", str(context), "--method", "snapkv",
        "--budget", "24", "--cap", "64", "--new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    output = stdout.splitlines()
    stats = [json.loads(line) for line in output if line.startswith("{")]
    assert [s["turns"] for s in stats] == [4, 8]
    assert stats[-1]["compactions"] >= 2 and stats[-1]["entries"] <= 64
    assert any(line.startswith(f"saved {talk}") for line in output)
    assert any("unknown command" in line for line in output)
    assert talk.is_file()

    monkeypatch.setattr("sys.stdin", io.StringIO(f"/load {talk}\n/stats\n{lines[4]}\n/stats\n"))
    code, stdout, err = run(capsys, "chat", "--model", str(tiny_dir), "--cache", str(talk), "--new-tokens", "4")
    assert code == 0, err
    stats = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [s["turns"] for s in stats] == [4, 5]


def test_chat_needs_a_budget_it_can_use(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("w1\n"))
    code, _, err = run(capsys, "chat", "--model", str(tiny_dir), "--budget", "0.1")
    assert code == 2 and "token count" in err
    code, _, err = run(capsys, "chat", "--model", str(tiny_dir), "--budget", "32", "--method", "pyramidkv")
    assert code == 2 and "freshly prefilled" in err
