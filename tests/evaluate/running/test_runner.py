"""The eval sweep on a tiny random model: record schema, one prefill per context, scoring, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvfold.evaluate.running.runner as runner
from kvfold.evaluate import Sample, evaluate
from kvfold.evaluate.running.runner import EvalSweep
from kvfold.evaluate.running.sweep import local_runner
from kvfold.pipeline.context import Answer, CompressedContext

CONTEXT_A = "The quick brown fox jumps over the lazy dog. " * 4
CONTEXT_B = "A journey of a thousand miles begins with one step. " * 3


def _samples() -> list[Sample]:
    """Three questions on one context (two tasks) and one on another."""
    return [
        Sample(CONTEXT_A, "\nWhich animal jumps?", ("fox",), "animals", "Answer:", 3, sample_id="a1"),
        Sample(CONTEXT_A, "\nWhich animal is lazy?", ("dog",), "animals", "Answer:", 3, sample_id="a2"),
        Sample(CONTEXT_A, "\nWhat colour?", ("brown",), "colours", "Answer:", 3, sample_id="a3"),
        Sample(CONTEXT_B, "\nHow long?", ("thousand",), "colours", "Answer:", 3, sample_id="b1"),
    ]


@pytest.fixture
def generate_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts CompressedContext.generate calls (the expensive part) and keeps the real behaviour."""
    calls: list[str] = []
    real = CompressedContext.generate

    def spy(self: CompressedContext, *args, **kwargs):
        calls.append(self.method.spec)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CompressedContext, "generate", spy)
    return calls


def test_records_schema_and_full_once(tiny_lm, tmp_path: Path) -> None:
    model, tok = tiny_lm
    result = evaluate(model, tok, _samples(), ["full", "streamingllm"], [0.5, 0.2], out_dir=tmp_path, progress=False)
    keys = {"method", "budget", "task", "score", "n", "query_aware", "kv_ratio"}
    assert all(keys <= set(r) for r in result.records)
    assert all(0.0 <= r["score"] <= 100.0 for r in result.records)
    runs = {(r["method"], r["budget"]) for r in result.records}
    assert runs == {("full", 1.0), ("streamingllm", 0.5), ("streamingllm", 0.2)}
    assert sorted(r["task"] for r in result.records if r["method"] == "full") == ["animals", "average", "colours"]
    average = next(r for r in result.records if r["method"] == "full" and r["task"] == "average")
    assert average["n"] == 4 and average["kv_ratio"] == pytest.approx(1.0)
    small = next(r for r in result.records if r["budget"] == 0.2 and r["task"] == "average")
    assert 0.15 < small["kv_ratio"] < 0.3
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(result.to_json()))
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 3
    row = json.loads(lines[0])
    for key in (
        "sample_id",
        "task",
        "method",
        "budget",
        "prediction",
        "answers",
        "score",
        "kv_bytes",
        "kv_bytes_full",
        "compress_seconds",
        "query_aware",
    ):
        assert key in row
    assert {p.name for p in tmp_path.iterdir()} >= {"run.json", "report.md", "scores.png", "scores_by_task.png"}


def test_each_context_is_prefilled_once(tiny_lm, monkeypatch: pytest.MonkeyPatch, generate_spy) -> None:
    model, tok = tiny_lm
    prefills: list[bool] = []
    real = runner.prefill

    def spy(*args, **kwargs):
        prefills.append(kwargs["query_aware"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "prefill", spy)
    evaluate(model, tok, _samples(), ["full", "random"], [0.5, 0.2], progress=False)
    assert prefills == [False, False]  # two contexts, whatever the methods and budgets
    assert len(generate_spy) == 4 * 3
    prefills.clear()
    result = evaluate(model, tok, _samples()[:3], ["streamingllm"], [0.5], query_aware=True, progress=False)
    assert prefills == [True] * 3  # query-aware: one prefill per question
    assert all(r["query_aware"] for r in result.records)


def test_scores_come_from_the_sample_metric(tiny_lm, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny_lm

    def oracle(self, question="", **kwargs):
        text = "a fox" if "jumps" in question else "no idea"
        return [Answer(text=text, token_ids=[], new_tokens=0, decode_seconds=0.0)]

    monkeypatch.setattr(CompressedContext, "generate", oracle)
    result = evaluate(model, tok, _samples(), ["full"], [0.5], progress=False)
    assert result.score("full", task="animals") == pytest.approx(50.0)
    assert result.score("full", task="colours") == 0.0
    assert result.score("full") == pytest.approx(25.0)  # macro average of the two tasks


def test_resume_does_no_new_work(tiny_lm, tmp_path: Path, generate_spy) -> None:
    model, tok = tiny_lm
    first = evaluate(model, tok, _samples(), ["full", "streamingllm"], [0.5], out_dir=tmp_path, progress=False)
    assert len(generate_spy) == 8
    predictions = (tmp_path / "predictions.jsonl").read_text()
    second = evaluate(model, tok, _samples(), ["full", "streamingllm"], [0.5], out_dir=tmp_path, progress=False)
    assert len(generate_spy) == 8  # nothing generated again
    assert second.records == first.records
    assert (tmp_path / "predictions.jsonl").read_text() == predictions


def test_resume_finishes_an_interrupted_run(tiny_lm, tmp_path: Path, generate_spy) -> None:
    model, tok = tiny_lm
    evaluate(model, tok, _samples(), ["full"], [0.5], out_dir=tmp_path, progress=False)
    path = tmp_path / "predictions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])  # killed while writing the 4th line
    generate_spy.clear()
    result = evaluate(model, tok, _samples(), ["full", "streamingllm"], [0.5], out_dir=tmp_path, progress=False)
    assert sorted(generate_spy) == ["full"] + ["streamingllm"] * 4
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 8 and len({(r["sample_id"], r["method"]) for r in rows}) == 8
    assert {r["method"] for r in result.records} == {"full", "streamingllm"}


def test_changed_config_is_refused(tiny_lm, tmp_path: Path) -> None:
    model, tok = tiny_lm
    config = {"model": "tiny", "dataset": "a.jsonl", "length": 2048, "seed": 0}
    evaluate(model, tok, _samples()[:1], ["full"], [0.5], out_dir=tmp_path, progress=False, run_config=config)
    with pytest.raises(ValueError, match=r"another configuration \(seed: 0 → 1\); use a new --out"):
        evaluate(
            model,
            tok,
            _samples()[:1],
            ["full"],
            [0.5],
            out_dir=tmp_path,
            progress=False,
            run_config={**config, "seed": 1},
        )


@pytest.mark.parametrize("changed", ["context", "answers"])
def test_resume_refuses_answers_to_a_changed_sample(tiny_lm, tmp_path: Path, changed: str) -> None:
    model, tok = tiny_lm
    evaluate(model, tok, _samples()[:1], ["full"], [0.5], out_dir=tmp_path, progress=False)
    (old,) = _samples()[:1]
    new = Sample(
        CONTEXT_B if changed == "context" else old.context,
        old.question,
        ("wolf",) if changed == "answers" else old.answers,
        old.task,
        old.answer_prefix,
        old.max_new_tokens,
        sample_id=old.sample_id,
    )
    with pytest.raises(ValueError, match=r"sample 'a1' written for another version .* use a new --out"):
        evaluate(model, tok, [new], ["full"], [0.5], out_dir=tmp_path, progress=False)


TIMINGS = ("prefill_seconds", "compress_seconds", "decode_seconds")


def _without_timings(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


def test_a_sweep_keeps_each_answer_once_in_serial_order(tiny_lm, tmp_path: Path) -> None:
    """A runner that answers items out of order and delivers every answer twice (a retried item) is
    written as the serial run would be: every answer once, in the serial order."""
    model, tok = tiny_lm
    methods, budgets = ["full", "streamingllm"], [0.5]
    serial = evaluate(model, tok, _samples(), methods, budgets, out_dir=tmp_path / "serial", progress=False)
    local = local_runner(model, tok)

    def shuffled_twice(items, status):
        assert [item.index for item in items] == [0, 1]  # two contexts
        rows = list(local(list(reversed(items)), status))
        yield from rows
        yield from reversed(rows)

    config = json.loads((tmp_path / "serial" / "run.json").read_text())
    sweep = EvalSweep(_samples(), methods, budgets, config, out_dir=tmp_path / "other", progress=False)
    result = sweep.run(shuffled_twice)
    assert len(result.predictions) == 4 * 2
    assert _without_timings(tmp_path / "other" / "predictions.jsonl") == _without_timings(
        tmp_path / "serial" / "predictions.jsonl"
    )
    assert [r["score"] for r in result.records] == [r["score"] for r in serial.records]


def test_a_sweep_refuses_a_runner_that_drops_answers(tiny_lm, tmp_path: Path) -> None:
    model, tok = tiny_lm
    local = local_runner(model, tok)

    def drops_last(items, status):
        yield from list(local(items, status))[:-1]

    with pytest.raises(RuntimeError, match="1 answers were not produced"):
        EvalSweep(_samples(), ["full"], [1.0], {}, out_dir=tmp_path, progress=False).run(drops_last)
    assert len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 3  # a rerun resumes from these
