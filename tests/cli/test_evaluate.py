"""``kvfold eval``, ``fidelity`` and ``report``: files, flags, one-line errors (tiny model; one SmolLM2 run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvfold
import kvfold.runtime.models
from kvfold.cli.main import main
from kvfold.evaluate.data.loaders import DEFAULT_RULER_SAMPLES
from tests.conftest import make_tiny_model
from tests.evaluate.conftest import CharTokenizer

FOX = "The quick brown fox jumps over the lazy dog. " * 3
DATASET = [
    {"context": FOX, "question": "\nWhat jumps?", "answers": ["fox"], "answer_prefix": "Answer:", "max_new_tokens": 4,
     "task": "animals"},
    {"context": FOX, "question": "\nWho is lazy?", "answers": ["dog"], "max_new_tokens": 4, "task": "animals"},
    {"context": "Paris is the capital of France. " * 3, "question": "\nCapital?", "answers": ["Paris"],
     "max_new_tokens": 4, "task": "capitals", "metric": "string_match_part"},
]  # fmt: skip


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace model loading by a tiny random model and the character tokenizer; record the specs."""
    specs: list[str] = []

    def load(spec: str, **kwargs):
        specs.append(spec)
        return kvfold.enable(make_tiny_model("llama", max_position_embeddings=2048)), CharTokenizer()

    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    return specs


def run(capsys, *parts: str | Path) -> tuple[int, str, str]:
    """Run ``kvfold``; string parts are split at whitespace, paths stay one argument."""
    argv = [a for p in parts for a in ([str(p)] if isinstance(p, Path) else p.split())]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_jsonl_end_to_end(capsys, loads, tmp_path: Path) -> None:
    data, out = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "run"
    args = ("eval --model tiny --dataset", data, "--methods full,streamingllm --budgets 0.5,0.3 --quiet --out", out)
    code, stdout, _ = run(capsys, *args)
    assert code == 0 and loads == ["tiny"]
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == "tiny"
    runs = {(r["method"], r["budget"]) for r in results["records"]}
    assert runs == {("full", 1.0), ("streamingllm", 0.5), ("streamingllm", 0.3)}
    assert {r["task"] for r in results["records"]} == {"animals", "capitals", "average"}
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 3 * 3
    assert json.loads((out / "run.json").read_text())["dataset"] == str(data)
    for name in ("report.md", "scores.png", "scores_by_task.png"):
        assert (out / name).stat().st_size > 0
    assert "streamingllm" in stdout and "score" in stdout
    code, _, err = run(capsys, *args, "--seed 1")
    assert code == 2 and "use a new --out directory" in err


def test_samples_per_task_and_task_filter(capsys, loads, tmp_path: Path) -> None:
    data, out = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "run"
    code, _, _ = run(capsys, "eval --dataset", data, "--samples 1 --tasks animals --methods full --quiet --out", out)
    assert code == 0
    rows = (out / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(r)["task"] for r in rows] == ["animals"]


def test_eval_ruler(capsys, loads, tmp_path: Path) -> None:
    out = tmp_path / "ruler"
    flags = "--length 700 --samples 1 --tasks vt,qa_1 --methods full,streamingllm --budgets 0.2 --quiet"
    code, _, _ = run(capsys, "eval --dataset ruler", flags, "--out", out)
    assert code == 0
    tasks = {r["task"] for r in json.loads((out / "results.json").read_text())["records"]}
    assert tasks == {"vt", "qa_1", "average"}


def test_eval_memory_sweep_compares_token_only_quantized_and_combined_pipelines(capsys, loads, tmp_path) -> None:
    """One sweep under memory budgets: each method keeps as many tokens as its precision allows, the
    quantization-only baseline runs once, every record carries the memory fields, and the report has
    the retention-against-memory table and plot."""
    data, out = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "run"
    methods = "full,snapkv@16,snapkv@int4,full@int4,snapkv"
    code, stdout, _ = run(capsys, "eval --dataset", data, f"--methods {methods} --memory 0.25,0.125 --quiet --out", out)
    assert code == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    for row in rows:
        assert {"kv_bytes", "memory", "memory_ratio", "kv_format"} <= set(row)
        if row["method"] not in ("full", "full@int4"):
            assert row["memory"] in (0.25, 0.125) and row["memory_ratio"] <= row["memory"]
    tokens = {(r["method"], r["memory"]): r["token_budget"] for r in rows if r["memory"] is not None}
    assert tokens[("snapkv@16", 0.125)] < tokens[("snapkv@int4", 0.125)]
    assert {r["kv_format"] for r in rows if r["method"] == "snapkv"} == {"int4"}  # the rule's choice
    assert {r["budget"] for r in rows if r["method"] == "full@int4"} == {1.0}
    report = (out / "report.md").read_text()
    assert "## Retention against memory" in report and "`snapkv@int4`" in report.split("## Retention against memory")[1]
    assert "of 16-bit" in stdout


def test_report_reads_results_written_before_the_memory_fields(capsys, loads, tmp_path: Path) -> None:
    data, out = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "run"
    assert run(capsys, "eval --dataset", data, "--methods full,streamingllm --budgets 0.5 --quiet --out", out)[0] == 0
    old = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    for row in old:
        for key in ("memory", "memory_ratio", "kv_format", "kv_bytes_16", "kv_bytes_full_16", "token_budget"):
            row.pop(key)
    _write_jsonl(out / "predictions.jsonl", old)
    results = json.loads((out / "results.json").read_text())
    for record in results["records"]:
        for key in ("memory", "memory_ratio", "kv_format", "kv_bytes"):
            record.pop(key, None)
    (out / "results.json").write_text(json.dumps(results))
    code, stdout, err = run(capsys, "report", out, "--markdown")
    assert code == 0 and "Traceback" not in err and "streamingllm" in stdout


def test_fidelity_cli(capsys, loads, tmp_path: Path) -> None:
    data, out = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "fid"
    code, stdout, _ = run(capsys, "fidelity --dataset", data, "--methods full,streamingllm --budgets 0.9,0.3 --quiet",
                          "--out", out)  # fmt: skip
    assert code == 0
    by_run = {(r["method"], r["budget"]): r for r in json.loads((out / "fidelity.json").read_text())["records"]}
    assert by_run[("full", 1.0)]["rel_error"] <= 1e-5
    assert by_run[("streamingllm", 0.3)]["rel_error"] > by_run[("streamingllm", 0.9)]["rel_error"]
    assert (out / "fidelity.md").exists() and (out / "fidelity.png").exists()
    assert "rel_error" in stdout


@pytest.mark.parametrize(
    "flags,message",
    [
        ("--methods full,nosuch", "unknown method 'nosuch'; valid:"),
        ("--methods streamingllm[sink=3]", "unknown option(s) sink"),
        ("--budgets 1.5", "budget must be a fraction in (0, 1] or a positive token count"),
        ("--dataset mmlu", "unknown dataset spec 'mmlu'; valid forms:"),
        ("--dataset BAD", "line 2: 'answers' must be a list of strings, got str"),
        ("--dataset MISSING", "dataset file not found:"),
        ("--samples 0", "--samples must be ≥ 1"),
        ("--memory 1.5", "a memory budget is a fraction in (0, 1]"),
        ("--kv-bits 5 --methods snapkv", "unknown KV format 'int5'"),
        ("--methods snapkv@int7", "unknown KV format 'int7'"),
    ],
)
def test_bad_input_is_one_line_before_loading(capsys, loads, tmp_path: Path, flags: str, message: str) -> None:
    rows = [{"context": "c", "question": "q", "answers": ["a"]}, {"context": "c", "question": "q", "answers": "a"}]
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    flags = flags.replace("BAD", str(bad)).replace("MISSING", str(tmp_path / "missing.jsonl"))
    base = {"--dataset": "ruler", "--methods": "full", "--budgets": "0.5"}
    defaults = " ".join(f"{k} {v}" for k, v in base.items() if k not in flags)
    for cmd in ("eval", "fidelity"):
        code, _, err = run(capsys, cmd, defaults, flags, "--out", tmp_path / "o")
        assert code == 2 and message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert loads == []  # refused before the model was loaded


@pytest.mark.model
def test_eval_on_smollm2(capsys, monkeypatch: pytest.MonkeyPatch, smollm2, tmp_path: Path) -> None:
    monkeypatch.setattr(kvfold.runtime.models, "load_model", lambda spec, **kwargs: smollm2)
    rows = [
        {"context": "The secret code is 4721. The weather was mild all week. " * 4, "question": "\nWhat is the code?",
         "answers": ["4721"], "answer_prefix": "The code is", "max_new_tokens": 8},
        {"context": "Marta keeps bees in a red hive behind the old mill. " * 4,
         "question": "\nWhat colour is the hive?", "answers": ["red"], "max_new_tokens": 8},
    ]  # fmt: skip
    data, out = _write_jsonl(tmp_path / "two.jsonl", rows), tmp_path / "run"
    code, _, _ = run(capsys, "eval --dataset", data, "--methods full,streamingllm --budgets 0.5 --quiet --out", out)
    assert code == 0
    records = json.loads((out / "results.json").read_text())["records"]
    averages = [(r["method"], r["budget"]) for r in records if r["task"] == "average"]
    assert averages == [("full", 1.0), ("streamingllm", 0.5)]
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 4
    for name in ("report.md", "scores.png", "scores_by_task.png", "run.json"):
        assert (out / name).exists()


def test_own_file_runs_every_line_unless_limited(capsys, loads, tmp_path: Path) -> None:
    rows = [
        {"context": f"Item {i} is kept in box {i}. " * 3, "question": f"\nBox of item {i}?", "answers": [str(i)],
         "max_new_tokens": 2, "task": "boxes"}
        for i in range(7)
    ]  # fmt: skip
    assert len(rows) > DEFAULT_RULER_SAMPLES  # the per-task default that used to cut a user's file
    data = _write_jsonl(tmp_path / "boxes.jsonl", rows)
    code, _, err = run(capsys, "eval --dataset", data, "--methods full --quiet --out", tmp_path / "all")
    assert code == 0 and "7 samples (7 contexts) in 1 tasks" in err
    assert len((tmp_path / "all" / "predictions.jsonl").read_text().splitlines()) == 7  # more than 3 (old default)
    code, _, err = run(capsys, "eval --dataset", data, "--limit 2 --methods full --quiet --out", tmp_path / "two")
    assert code == 0 and "2 samples" in err
    assert len((tmp_path / "two" / "predictions.jsonl").read_text().splitlines()) == 2


def test_a_multi_question_line_is_compressed_once(capsys, loads, tmp_path: Path, monkeypatch) -> None:
    from kvfold.pipeline.context import PrefilledContext

    calls: list[str] = []
    original = PrefilledContext.compress

    def counting(self, method, budget, **kwargs):
        calls.append(str(budget))
        return original(self, method, budget, **kwargs)

    monkeypatch.setattr(PrefilledContext, "compress", counting)
    row = {"context": FOX, "questions": ["\nWhat jumps?", "\nWho is lazy?", "\nWhat colour?"],
           "answers": [["fox"], ["dog"], ["brown"]], "max_new_tokens": 3, "task": "animals"}  # fmt: skip
    data = _write_jsonl(tmp_path / "multi.jsonl", [row])
    flags = "--methods streamingllm --budgets 0.5,0.2 --quiet --out"
    code, _, err = run(capsys, "eval --dataset", data, flags, tmp_path / "m")
    assert code == 0 and "3 samples (1 contexts)" in err
    assert len(calls) == 2 and len(set(calls)) == 2  # one compression per budget, three answers from each
    predictions = [json.loads(line) for line in (tmp_path / "m" / "predictions.jsonl").read_text().splitlines()]
    assert [p["sample_id"] for p in predictions] == ["animals/1/q0", "animals/1/q1", "animals/1/q2"] * 2
    assert [p["budget"] for p in predictions] == [0.5] * 3 + [0.2] * 3
    assert len({p["context_id"] for p in predictions}) == 1
    bad = dict(row, answers=[["fox"], ["dog"]])
    code, _, err = run(capsys, "eval --dataset", _write_jsonl(tmp_path / "bad.jsonl", [bad]),
                       "--methods full --quiet --out", tmp_path / "b")  # fmt: skip
    assert code == 2 and "one per question" in err


def test_report_prints_the_tables_of_one_run_or_of_several_merged(capsys, loads, tmp_path: Path) -> None:
    data, first, second = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "first", tmp_path / "second"
    flags = "--budgets 0.5,0.3 --quiet --out"
    assert run(capsys, "eval --dataset", data, "--methods full,streamingllm", flags, first)[0] == 0
    assert run(capsys, "eval --dataset", data, "--methods snapkv,full", flags, second)[0] == 0
    code, markdown, _ = run(capsys, "report", first, "--markdown")
    report = (first / "report.md").read_text()
    assert code == 0 and report.startswith(markdown) and report[len(markdown) :].startswith("\n![")  # then plots
    code, merged, _ = run(capsys, "report", first, second, "--markdown")
    assert code == 0 and "| method | 0.5 | 0.3 |" in merged
    averages = merged.split("## Average score by budget")[1].split("##")[0]
    assert [line.split(" | ")[0] for line in averages.splitlines() if line.startswith("| `")] == [
        "| `full`", "| `streamingllm`", "| `snapkv`"
    ]  # fmt: skip
    code, _, err = run(capsys, "report", first, second, "--out", tmp_path / "merged")  # the merged report, plots too
    written = (tmp_path / "merged" / "report.md").read_text()
    assert code == 0 and "report.md" in err and written.startswith(merged) and "`snapkv`" in written
    assert (tmp_path / "merged" / "scores.png").stat().st_size > 0
    code, lines, _ = run(capsys, "report", first, second)
    methods = [line.split()[0] for line in lines.splitlines()]  # one line per method and budget
    assert code == 0 and methods == ["full"] + ["streamingllm"] * 2 + ["snapkv"] * 2
    assert run(capsys, "eval --dataset", data, "--methods snapkv --seed 1", flags, tmp_path / "seed1")[0] == 0
    code, lines, _ = run(capsys, "report", first, tmp_path / "seed1")  # another configuration: reported apart
    headings = [line for line in lines.splitlines() if line.startswith("# ")]
    assert code == 0 and len(headings) == 2 and "seed 1" in headings[1] and "seed" not in headings[0]
    code, markdown, _ = run(capsys, "report", first, tmp_path / "seed1", "--markdown", "--out", tmp_path / "apart")
    assert code == 0 and markdown.count("\n## eval runs on ") + markdown.startswith("## eval runs on ") == 2
    assert (tmp_path / "apart" / "eval-1" / "report.md").is_file()
    assert (tmp_path / "apart" / "eval-2" / "report.md").is_file()
    other = _write_jsonl(tmp_path / "other.jsonl", DATASET)  # another dataset: `kvfold report runs/ruler runs/mine`
    assert run(capsys, "eval --dataset", other, "--methods full", flags, tmp_path / "other")[0] == 0
    code, lines, _ = run(capsys, "report", first, tmp_path / "other")
    headings = [line for line in lines.splitlines() if line.startswith("# ")]
    assert code == 0 and [str(data) in headings[0], str(other) in headings[1]] == [True, True]
    code, _, err = run(capsys, "report", tmp_path)
    assert code == 2 and "holds no predictions.jsonl" in err


def test_report_prints_eval_and_fidelity_tables_together(capsys, loads, tmp_path: Path) -> None:
    data, scores, errors = _write_jsonl(tmp_path / "mini.jsonl", DATASET), tmp_path / "eval", tmp_path / "fid"
    flags = "--methods full,streamingllm --budgets 0.5 --quiet --out"
    assert run(capsys, "eval --dataset", data, flags, scores)[0] == 0
    assert run(capsys, "fidelity --dataset", data, flags, errors)[0] == 0
    code, markdown, _ = run(capsys, "report", errors, scores, "--markdown")  # eval first, whatever the order
    eval_part, fidelity_part = markdown.split("\n# kvfold fidelity\n")
    assert code == 0 and (scores / "report.md").read_text().startswith(eval_part)
    assert (errors / "fidelity.md").read_text().startswith("# kvfold fidelity\n" + fidelity_part)
    code, lines, _ = run(capsys, "report", scores, errors)
    assert code == 0 and "rel_error" in lines.splitlines()[-1] and "score" in lines.splitlines()[0]
