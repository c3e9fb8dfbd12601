"""``kvfold eval --ray`` and ``kvfold fidelity --ray``: a local Ray cluster of 2 workers gives what
a serial run gives.

A tiny random Llama and a byte-level tokenizer are saved as a model directory, so the Ray
workers load the model the way ``kvfold`` does (:class:`kvfold.evaluate.running.distributed.ModelLoader`).
Tests that need Ray are skipped when it is not installed (``pip install 'kvfold[ray]'``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from kvfold.cli.evaluate import load_samples
from kvfold.cli.main import main
from kvfold.evaluate.running.runner import EvalSweep, row_key
from kvfold.runtime.models import load_tokenizer
from tests.conftest import make_tiny_model


def _ray_importable() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


needs_ray = pytest.mark.skipif(not _ray_importable(), reason="Ray is not installed: pip install 'kvfold[ray]'")

TIMING_FIELDS = {"prefill_seconds", "compress_seconds", "decode_seconds"}
"""Prediction fields that measure time (they differ between any two runs)."""
DERIVED_TIMING_FIELDS = {"compress_over_prefill"}
"""Record fields computed from timings."""

LETTERS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]


def _dataset() -> list[dict]:
    """Six contexts in two tasks; four of them carry two questions (one prefill answers both)."""
    rows = []
    for n in range(6):
        context = " ".join(LETTERS[(n + i) % len(LETTERS)] for i in range(40)) + f" The code is {n}{n + 3}."
        task = "codes" if n % 2 else "words"
        rows.append(
            {
                "context": context,
                "question": "\nWhat is the code?",
                "answers": [f"{n}{n + 3}"],
                "task": task,
                "max_new_tokens": 3,
            }
        )
        if n < 4:
            rows.append(
                {
                    "context": context,
                    "question": "\nFirst word?",
                    "answers": [LETTERS[n]],
                    "task": task,
                    "max_new_tokens": 2,
                }
            )
    return rows  # fmt: skip


DATASET = _dataset()
METHODS = "full,streamingllm,snapkv"
BUDGETS = "0.5,0.3"
ANSWERS = len(DATASET) * (1 + 2 * 2)  # full once, the two others at two budgets


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer, saved as a transformers directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([row["context"] + row["question"] for row in DATASET], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    model = make_tiny_model(
        "llama", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "mini.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in DATASET), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def serial(tiny_dir: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The serial run of the grid (the reference every Ray run must reproduce)."""
    out = tmp_path_factory.mktemp("serial")
    assert main(_eval_args(tiny_dir, data, out)) == 0
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with 2 CPUs (so 2 workers), shut down after this module's tests."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvfold[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


def _eval_args(tiny_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "eval", "--model", str(tiny_dir), "--dataset", str(data), "--methods", METHODS, "--budgets", BUDGETS,
        "--quiet", "--out", str(out), *extra,
    ]  # fmt: skip


def _predictions(out: Path) -> list[dict]:
    """predictions.jsonl in file order, timings removed."""
    lines = (out / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in lines]


def _records(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    for record in results["records"]:
        for name in DERIVED_TIMING_FIELDS:
            record.pop(name)
    return results


def _workers(stderr: str) -> dict[str, int]:
    """``host:pid → answers`` from the line ``kvfold eval --ray`` prints."""
    line = re.search(r"answers by Ray worker: (.*)", stderr)
    assert line, stderr
    return {name: int(n) for name, n in re.findall(r"(\S+:\d+) (\d+)", line.group(1))}


def test_serial_reference_is_complete(serial: Path) -> None:
    predictions = _predictions(serial)
    assert len(predictions) == ANSWERS == len({row_key(p) for p in predictions})
    assert {p["method"] for p in predictions} == {"full", "streamingllm", "snapkv"}


@needs_ray
def test_ray_alone_starts_a_local_instance_and_stops_it(tiny_dir, data, tmp_path, capsys) -> None:
    import ray

    if ray.is_initialized():  # pragma: no cover - this test runs before the module's cluster starts
        pytest.fail("run this test before the ray_cluster fixture: it checks that --ray starts and stops Ray")
    out = tmp_path / "local"
    args = _eval_args(tiny_dir, data, out, "--ray", "--tasks", "codes", "--limit", "3")
    args[args.index("--methods") + 1], args[args.index("--budgets") + 1] = "full,streamingllm", "0.5"
    capsys.readouterr()
    assert main(args) == 0
    _, err = capsys.readouterr()
    assert "on a local Ray instance" in err
    started = int(re.search(r"Ray workers started: (\d+)", err).group(1))
    assert started == min(os.cpu_count() or 1, 2)  # one per core, at most one per context (2 here)
    assert sum(_workers(err).values()) == 3 * 2 == len(_predictions(out))
    assert not ray.is_initialized()  # the instance it started is stopped


def _run_on_two_workers(args: list[str], capsys) -> dict[str, int]:
    """Run ``kvfold`` with ``--ray-workers 2``; check that two workers started and that every
    answer came from a worker process, none from this one (which of the two answers what depends
    on when each finished loading; the test that kills a worker shows two answering). Returns
    the answers by worker."""
    capsys.readouterr()
    assert main(args) == 0
    _, err = capsys.readouterr()
    workers = _workers(err)
    assert "Ray workers started: 2;" in err
    assert workers and all(int(name.rsplit(":", 1)[1]) != os.getpid() for name in workers), workers
    return workers


@needs_ray
def test_local_cluster_matches_serial(ray_cluster, tiny_dir, data, serial, tmp_path, capsys) -> None:
    out = tmp_path / "ray"
    workers = _run_on_two_workers(_eval_args(tiny_dir, data, out, "--ray", "--ray-workers", "2"), capsys)
    assert sum(workers.values()) == ANSWERS
    assert _predictions(out) == _predictions(serial)  # same rows, same order
    assert _records(out) == _records(serial)
    assert json.loads((out / "run.json").read_text()) == json.loads((serial / "run.json").read_text())
    assert (out / "report.md").stat().st_size > 0


@needs_ray
def test_resume_sends_only_missing_answers(ray_cluster, tiny_dir, data, serial, tmp_path, capsys) -> None:
    out = tmp_path / "resumed"
    out.mkdir()
    (out / "run.json").write_text((serial / "run.json").read_text())
    lines = (serial / "predictions.jsonl").read_text().splitlines(keepends=True)
    kept = 7  # inside the first context's 10 answers: that context is resubmitted for the rest only
    (out / "predictions.jsonl").write_text("".join(lines[:kept]))
    capsys.readouterr()
    assert main(_eval_args(tiny_dir, data, out, "--ray", "--ray-workers", "2")) == 0
    _, err = capsys.readouterr()
    workers = _workers(err)
    assert workers and all(int(name.rsplit(":", 1)[1]) != os.getpid() for name in workers), workers
    assert sum(workers.values()) == ANSWERS - kept
    assert (out / "predictions.jsonl").read_text().splitlines(keepends=True)[:kept] == lines[:kept]
    assert _predictions(out) == _predictions(serial)
    assert _records(out) == _records(serial)

    capsys.readouterr()  # a third run finds everything done and starts no work
    assert main(_eval_args(tiny_dir, data, out, "--ray")) == 0
    assert "none (all resumed)" in capsys.readouterr().err
    assert _predictions(out) == _predictions(serial)


@needs_ray
def test_lost_worker_loses_nothing_and_counts_nothing_twice(ray_cluster, tiny_dir, data, serial, tmp_path) -> None:
    from kvfold.evaluate.running.distributed import ModelLoader, RayRunner

    out = tmp_path / "crash"
    runner = RayRunner(ModelLoader(str(tiny_dir)), workers=2, kill_after=1)  # killed after its first answer
    tokenizer = load_tokenizer(str(tiny_dir))
    samples = load_samples(_Args(str(data)), tokenizer)
    config = json.loads((serial / "run.json").read_text())
    counted: list[int] = []
    sweep = EvalSweep(samples, METHODS.split(","), BUDGETS.split(","), config, out_dir=out, progress=False)
    result = sweep.run(_counting(runner, counted))
    assert runner.workers_lost == 1 and runner.resubmitted == 1
    # the killed worker (its first answer) and another that finished its context (≥ 4 answers left)
    assert len(runner.answers_by_worker) >= 2
    assert all(int(name.rsplit(":", 1)[1]) != os.getpid() for name in runner.answers_by_worker)
    assert sum(counted) == ANSWERS  # what the killed worker delivered was kept, not answered again
    assert len(result.predictions) == ANSWERS
    assert _predictions(out) == _predictions(serial)
    assert _records(out) == _records(serial)


FIDELITY_RUNS = 1 + 2 * 2  # full once, the two others at two budgets


def _fidelity_args(tiny_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["fidelity", *_eval_args(tiny_dir, data, out, *extra)[1:]]


def _serial_fidelity(tiny_dir: Path, data: Path, out: Path, *extra: str) -> Path:
    """A serial ``kvfold fidelity`` run with one torch thread, as each Ray worker has (so the
    floating-point sums are the same ones, and the measures equal to the last bit)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_fidelity_args(tiny_dir, data, out, *extra)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _fidelity_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "fidelity_samples.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def serial_fidelity(tiny_dir: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _serial_fidelity(tiny_dir, data, tmp_path_factory.mktemp("serial-fidelity"))


@needs_ray
def test_fidelity_on_local_cluster_matches_serial(
    ray_cluster, tiny_dir, data, serial_fidelity, tmp_path, capsys
) -> None:
    out = tmp_path / "ray-fidelity"
    workers = _run_on_two_workers(_fidelity_args(tiny_dir, data, out, "--ray", "--ray-workers", "2"), capsys)
    rows = _fidelity_rows(out)
    assert sum(workers.values()) == len(rows) == len(DATASET) * FIDELITY_RUNS
    assert rows == _fidelity_rows(serial_fidelity)  # same rows, same order, same measures
    for name in ("fidelity.json", "run.json"):
        assert json.loads((out / name).read_text()) == json.loads((serial_fidelity / name).read_text())


@needs_ray
def test_fidelity_online_resumes_on_the_cluster(ray_cluster, tiny_dir, data, tmp_path, capsys) -> None:
    """``--online`` on Ray, resumed from a serial run's first rows (cut mid-line), equals the serial run."""
    extra = ("--online", "--methods", "full,streamingllm,snapkv", "--budgets", "0.5")
    serial = _serial_fidelity(tiny_dir, data, tmp_path / "serial-online", *extra)
    lines = (serial / "fidelity_samples.jsonl").read_text().splitlines(keepends=True)
    kept = 4  # the first question of the first context (3 runs) and full of its second: a half-done item
    out = tmp_path / "resumed"
    out.mkdir()
    (out / "run.json").write_text((serial / "run.json").read_text())
    (out / "fidelity_samples.jsonl").write_text("".join(lines[:kept]) + lines[kept][:25])
    capsys.readouterr()
    assert main(_fidelity_args(tiny_dir, data, out, "--ray", "--ray-workers", "2", *extra)) == 0
    workers = _workers(capsys.readouterr().err)
    assert sum(workers.values()) == len(lines) - kept
    assert _fidelity_rows(out) == _fidelity_rows(serial)
    result = json.loads((out / "fidelity.json").read_text())
    assert result == json.loads((serial / "fidelity.json").read_text()) and result["online"] is True
    assert {r["method"]: r.get("online_path") for r in result["records"]}["snapkv"] is False

    capsys.readouterr()  # a third run finds everything done and starts no work
    assert main(_fidelity_args(tiny_dir, data, out, "--ray", *extra)) == 0
    assert "none (all resumed)" in capsys.readouterr().err


@needs_ray
def test_fidelity_lost_worker_loses_nothing(ray_cluster, tiny_dir, data, serial_fidelity, tmp_path) -> None:
    from kvfold.evaluate.running.distributed import ModelLoader, RayRunner
    from kvfold.evaluate.running.fidelity import FidelitySweep

    runner = RayRunner(ModelLoader(str(tiny_dir)), workers=2, kill_after=2)  # killed after its 2nd row
    samples = load_samples(_Args(str(data)), load_tokenizer(str(tiny_dir)))
    config = json.loads((serial_fidelity / "run.json").read_text())
    counted: list[int] = []
    config = {k: config[k] for k in ("model", "dataset", "length", "seed")}  # the mode is added back
    out = tmp_path / "crash"
    sweep = FidelitySweep(samples, METHODS.split(","), BUDGETS.split(","), config, out_dir=out, progress=False)
    sweep.run(_counting(runner, counted))
    assert runner.workers_lost == 1 and runner.resubmitted == 1
    assert sum(counted) == len(DATASET) * FIDELITY_RUNS  # the killed worker's rows kept, none measured twice
    assert _fidelity_rows(out) == _fidelity_rows(serial_fidelity)


@pytest.mark.parametrize("command", ["eval", "fidelity"])
def test_ray_missing_says_how_to_install(command, tiny_dir, data, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code = main([command, *_eval_args(tiny_dir, data, tmp_path / "out", "--ray")[1:]])
    _, err = capsys.readouterr()
    assert code == 2
    assert "pip install 'kvfold[ray]'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # it failed before doing anything


class _Args:
    """The selection flags of ``kvfold eval`` for :func:`load_samples` (a whole JSONL file)."""

    def __init__(self, dataset: str) -> None:
        self.dataset, self.tasks, self.samples, self.limit, self.length, self.seed = dataset, None, None, None, 2048, 0


def _counting(runner, counted: list[int]):
    """Wrap a runner so that every row it yields is counted (duplicates included)."""

    def run(items, status):
        for row in runner(items, status):
            counted.append(1)
            yield row

    return run


def test_a_sweep_with_nothing_left_starts_no_ray(monkeypatch) -> None:
    """A resumed sweep whose answers are all on disk gives the runner no items: Ray is never
    joined or started (it took 15–20 s); the first items join it, once."""
    import contextlib

    from kvfold.evaluate.running import distributed

    class Joined(Exception):
        pass

    joined: list[str | None] = []

    @contextlib.contextmanager
    def session(address, num_cpus=None):
        joined.append(address)
        raise Joined
        yield  # pragma: no cover

    monkeypatch.setattr(distributed, "ray_session", session)
    result, runner = distributed.run_on_ray(None, lambda r: list(r([], lambda _: None)), address="auto")
    assert result == [] and joined == [] and runner.workers_started == 0
    with pytest.raises(Joined):
        distributed.run_on_ray(None, lambda r: list(r(["item"], lambda _: None)), address="auto")
    assert joined == ["auto"]
