"""The fault tour: every command that writes, met with bad input, failed I/O and interruption.

The commands run for real on a tiny random model saved to a folder:

* in a fresh interpreter (``python -m kvfold.cli ...``) for what a user meets first: an unwritable
  ``--out``, two sweeps on one folder, Ctrl-C in a sweep;
* in a process forked from a server that imported kvfold once (:class:`ForkServer`), where a case
  needs many runs or a pause at a chosen point (in the middle of a save): the same ``main`` on the
  same arguments, in a process of its own that a signal ends, at a fraction of the start-up cost;
* in this process (``main(argv)``) for bad input, a full disk and a permission error, which are
  simulated by a write that fails (tests run as root: a mode does not stop them).

Each case checks the exit status, that stderr ends in one line and holds no traceback, and that the
files on disk are complete and loadable. ``docs/faults.md`` tabulates what the user sees.
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfold.cli.main import main
from kvfold.runtime.files import LOCK_FILE, TEMP_MARK, read_jsonl
from kvfold.store.format import read_info, read_tensors
from tests.evaluate.bench.conftest import write_tiny_model

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}
SAMPLES = 30
"""Samples of the sweep data (one context each): with two runs, 60 answers of about 25 ms."""
SWEEP = ("--methods", "full,streamingllm", "--budgets", "0.5", "--quiet")
PROGRESS = re.compile(r"\d+%\|")
ANNOUNCEMENT = re.compile(r"^\d+ samples \(\d+ contexts\) in \d+ tasks: .* → |^kvfold [\w-]+: (?!error: )")
"""A sweep's announcement, or a progress line (``kvfold compress: loading ...``; ``--quiet`` drops them)."""


def words(n: int, shift: int = 0) -> str:
    """``n`` words of the tiny tokenizer's vocabulary (``w1`` … ``w96``), one token each."""
    return " ".join(f"w{(i * 7 + shift * 13) % 96 + 1}" for i in range(n))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class World:
    """The tiny model, the data and the files the cases share (made once for the module)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = str(write_tiny_model(root / "tiny"))
        self.context = root / "context.txt"
        self.context.write_text(words(160))
        sample = {"question": "w3 w5 w7", "answers": ["w9"], "max_new_tokens": 8}
        rows = [{"context": words(160, k), **sample, "task": f"t{k % 2}", "sample_id": f"s{k}"} for k in range(SAMPLES)]
        self.data = write_rows(root / "data.jsonl", rows)
        self.small = write_rows(root / "small.jsonl", rows[:4])
        self.no_answers = write_rows(root / "no_answers.jsonl", [{"context": words(20), "question": "w3"}])
        self.long_data = write_rows(root / "long.jsonl", [{"context": words(700), "question": "w3", "answers": ["w1"]}])
        self.empty = root / "empty.txt"
        self.empty.write_text("")
        self.long = root / "long.txt"
        self.long.write_text(words(700))
        self.kvc = root / "doc.kvc"
        assert main(self.compress(self.kvc)) == 0
        self.garbage = root / "garbage.kvc"
        self.garbage.write_bytes(b"not a cache file " * 8)
        data = bytearray(self.kvc.read_bytes())
        data[len(data) // 2] ^= 0x01
        self.flipped = root / "flipped.kvc"
        self.flipped.write_bytes(bytes(data))
        self.a_file = root / "a_file"
        self.a_file.write_text("a file, not a folder\n")

    def compress(self, out: Path, budget: str = "0.5") -> list[str]:
        return ["compress", "--model", self.model, "--context-file", str(self.context), "--method", "snapkv",
                "--budget", budget, "--out", str(out)]  # fmt: skip

    def sweep(self, command: str, out: Path, data: Path | None = None, *extra: str) -> list[str]:
        return [command, "--model", self.model, "--dataset", str(data or self.data), *SWEEP, "--out", str(out), *extra]

    def chat(self, *extra: str) -> list[str]:
        return ["chat", "--model", self.model, "--context-file", str(self.context), "--budget", "48",
                "--new-tokens", "2", *extra]  # fmt: skip

    def mergemap(self, out: Path) -> list[str]:
        return ["mergemap", "--model", self.model, "--context-file", str(self.context), "--methods", "snapkv+cam",
                "--budget", "0.5", "--out", str(out)]  # fmt: skip

    def bench(self, out: Path, *extra: str) -> list[str]:
        return ["bench", "--model", self.model, "--methods", "streamingllm", "--budgets", "0.5", "--length", "64",
                "--batch", "1", "--new-tokens", "2", "--out", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("faults"))


# ----------------------------------------------------------------------------- running the commands


def call(capsys, argv: list[str], stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """``kvfold ARGV`` in this process: exit status, stdout, stderr."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def error_line(stderr: str, command: str) -> str:
    """The one line a failed command ends with; nothing else on stderr but its announcement and progress bar."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in re.split(r"[\r\n]", stderr) if line.strip() and not PROGRESS.search(line)]
    assert lines and lines[-1].startswith(f"kvfold {command}: "), stderr
    assert all(ANNOUNCEMENT.match(line) for line in lines[:-1]), stderr
    return lines[-1]


class Proc:
    """A command running in a process of its own: a fresh interpreter, or forked from :class:`ForkServer`."""

    started: list[Proc] = []
    """Every command started, so that none outlives its test (:func:`no_command_left`)."""

    def __init__(self, folder: Path, popen: subprocess.Popen | None = None) -> None:
        self.folder = folder
        self.popen = popen
        self._pid = popen.pid if popen else None
        Proc.started.append(self)

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = int(wait_for(lambda: _read(self.folder / "pid"), "the forked command's pid"))
        return self._pid

    def status(self) -> int | None:
        """The exit status (negative: the signal that ended it), or None while it runs."""
        if self.popen is not None:
            return self.popen.poll()
        text = _read(self.folder / "status")
        return int(text) if text else None

    def send(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        return wait_for(self.status, "the command to end", timeout, done=lambda s: s is not None)

    @property
    def stdout(self) -> str:
        return (self.folder / "stdout").read_text()

    @property
    def stderr(self) -> str:
        return (self.folder / "stderr").read_text()


@pytest.fixture(autouse=True)
def no_command_left() -> Iterator[None]:
    """A test that fails half-way leaves no command running (or stopped) behind it."""
    yield
    while Proc.started:
        proc = Proc.started.pop()
        if (proc.popen is not None or (proc.folder / "pid").exists()) and proc.status() is None:
            proc.send(signal.SIGKILL)
            proc.wait()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def wait_for(probe: Callable[[], object], what: str, timeout: float = 120, done=bool) -> object:
    """Poll ``probe`` every 2 ms until ``done(value)``."""
    end = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def spawn(argv: list[str], folder: Path) -> Proc:
    """``python -m kvfold.cli ARGV`` in a fresh interpreter; stdout and stderr into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "stdout").open("w") as out, (folder / "stderr").open("w") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvfold.cli", *map(str, argv)],
            stdout=out,
            stderr=err,
            env=ENV,
            preexec_fn=default_sigint,
        )
    return Proc(folder, popen)


def default_sigint() -> None:
    """Ctrl-C's default action in a child, as a terminal gives it: a shell without job control
    starts background commands with SIGINT ignored, and a Python started so never raises
    ``KeyboardInterrupt`` (the Ctrl-C tests then saw the sweep finish, exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


FORK_SERVER = r"""
import json, os, signal, sys, time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: F401
import safetensors.torch  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import kvfold.cli.bench, kvfold.cli.diagnostics, kvfold.cli.evaluate, kvfold.cli.saved_caches  # noqa: F401
from kvfold.cli.main import main


def pause_in(call, name, marker, skip=0):
    # the command stops for good in os.<call> on a file named NAME or on its temporary file
    real, seen = getattr(os, call), [0]

    def paused(fd, *rest):
        try:
            base = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            base = ""
        if base == name or base.startswith(f".{name}."):
            seen[0] += 1
            if seen[0] > skip:
                if call == "write":  # half of it written, then the pause
                    real(fd, bytes(rest[0][: max(1, len(rest[0]) // 2)]))
                open(marker, "w").close()
                while True:
                    time.sleep(1)
        return real(fd, *rest)

    setattr(os, call, paused)


def command(request):
    folder = request["folder"]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        handle = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(request.get("stdin") or os.devnull, encoding="utf-8")
    if request.get("pause"):
        pause_in(**request["pause"])
    try:
        code = main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def publish(path, text):
    with open(path + ".part", "w") as handle:
        handle.write(text)
    os.replace(path + ".part", path)


def watch(request):
    # between the server and the command: reports the command's pid, then its exit status
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        command(request)
    publish(os.path.join(request["folder"], "pid"), str(pid))
    _, status = os.waitpid(pid, 0)
    publish(os.path.join(request["folder"], "status"), str(os.waitstatus_to_exitcode(status)))
    os._exit(0)


signal.signal(signal.SIGCHLD, signal.SIG_IGN)
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        watch(request)
"""


class ForkServer:
    """A process that imported kvfold once and forks a process per command (``main(argv)``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0
        self.server = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=ENV,
            text=True,
            preexec_fn=default_sigint,
        )
        assert self.server.stdout.readline() == "ready\n"

    def run(self, argv: list[str], *, stdin: str | None = None, pause: dict | None = None) -> Proc:
        self.count += 1
        folder = self.root / f"command-{self.count}"
        folder.mkdir()
        request = {"argv": [str(a) for a in argv], "folder": str(folder), "pause": pause}
        if stdin is not None:
            (folder / "stdin").write_text(stdin)
            request["stdin"] = str(folder / "stdin")
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        return Proc(folder)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path_factory.mktemp("forks"))
    yield server
    server.close()


def pause(call: str, name: str, folder: Path, skip: int = 0) -> dict:
    """Stop the command for good in ``os.<call>`` on ``name`` (or its temporary file); the marker says when."""
    return {"call": call, "name": name, "marker": str(folder / "paused"), "skip": skip}


def paused(proc: Proc, folder: Path) -> None:
    """Wait until the command stops at its pause (:func:`pause`); a command that ended first fails the test."""
    marker = folder / "paused"
    wait_for(lambda: marker.exists() or proc.status() is not None, "the pause")
    assert marker.exists(), f"the command ended before its pause: {proc.status()}\n{proc.stderr}"
    marker.unlink()


# ----------------------------------------------------------------------------- what is on disk


def lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if TEMP_MARK in p.name)


def assert_complete(folder: Path, *, torn_allowed: bool = False) -> None:
    """Every file of an output folder is whole: JSON loads, rows parse, PNGs end, cache files verify."""
    for path in folder.iterdir():
        if TEMP_MARK in path.name or path.name == LOCK_FILE:
            continue
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            read_jsonl(path)
            assert torn_allowed or path.read_bytes().endswith(b"\n") or not path.read_bytes(), path
        elif path.suffix == ".png":
            data = path.read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82"), path
        elif path.suffix == ".kvc":
            read_tensors(read_info(path), verify=True)


def untimed(row: dict) -> dict:
    """A row or record without what a clock measured."""
    return {k: v for k, v in row.items() if "seconds" not in k and k != "compress_over_prefill"}


def eval_key(row: dict) -> tuple:
    return row["sample_id"], row["method"], json.dumps(row["budget"])


# ----------------------------------------------------------------------------- bad input


def bad_inputs(w: World, tmp: Path) -> list[tuple[list[str], str]]:
    """Every bad input of the issue, for every command it applies to: ``(argv, what stderr says)``."""
    budget_flags = {"compress": "--budget", "eval": "--budgets", "fidelity": "--budgets", "bench": "--budgets",
                    "mergemap": "--budget", "chat": "--budget"}  # fmt: skip
    base = {
        "compress": w.compress(tmp / "x.kvc"),
        "eval": w.sweep("eval", tmp / "run", w.small),
        "fidelity": w.sweep("fidelity", tmp / "fid", w.small),
        "bench": w.bench(tmp / "bench"),
        "mergemap": w.mergemap(tmp / "mm"),
        "chat": w.chat(),
        "merged-entries": [
            "merged-entries",
            "--model",
            w.model,
            "--task",
            "niah_single_1",
            "--base",
            "snapkv",
            "--methods",
            "snapkv+cam",
        ],  # fmt: skip
    }

    def with_(argv: list[str], flag: str, value: str) -> list[str]:
        if flag not in argv:
            return [*argv, flag, value]
        at = argv.index(flag)
        return [*argv[: at + 1], value, *argv[at + 2 :]]

    cases = []
    for command, argv in base.items():
        flag = budget_flags.get(command, "--budget")
        method_flag = {"compress": "--method", "chat": "--method", "merged-entries": "--base"}.get(command, "--methods")
        cases += [
            (with_(argv, flag, "0"), "budget must be a fraction in (0, 1] or a positive token count"),
            (with_(argv, flag, "1.5"), "budget must be a fraction in (0, 1] or a positive token count"),
            ([*argv, "--bogus"], f"kvfold {command}: error: unrecognized arguments: --bogus"),
            (with_(argv, method_flag, "snapkv[window=-1]"), "snapkv: window must be ≥ 1; got -1"),
        ]
        if command != "bench":  # bench reads its model in a measuring process: tests/cli/test_bench.py
            cases.append((with_(argv, "--model", str(tmp / "no-model")), "model path not found or not a model"))
    empty, long, too_long = str(w.empty), str(w.long), "need 701 tokens but the model supports 512 positions"
    cases += [
        (with_(base["compress"], "--context-file", empty), f"context file {empty} is empty; give a file with the text"),
        (with_(base["chat"], "--context-file", empty), f"context file {empty} is empty; give a file with the text"),
        (with_(base["mergemap"], "--context-file", empty), f"context file {empty} is empty; give a file with the text"),
        (with_(base["eval"], "--dataset", str(w.no_answers)), "line 1: missing required field(s) 'answers'"),
        (with_(base["fidelity"], "--dataset", str(w.no_answers)), "line 1: missing required field(s) 'answers'"),
        (
            [
                "mergemap",
                "--model",
                w.model,
                "--dataset",
                str(w.no_answers),
                "--methods",
                "snapkv",
                "--out",
                str(tmp / "mm"),
            ],
            "line 1: missing required field(s) 'answers'",
        ),  # fmt: skip
        (with_(base["compress"], "--context-file", long), too_long),
        (with_(base["chat"], "--context-file", long), too_long),
        (with_(base["mergemap"], "--context-file", long), too_long),
        (with_(base["eval"], "--dataset", str(w.long_data)), too_long),
        (with_(base["fidelity"], "--dataset", str(w.long_data)), too_long),
    ]
    full_out_of_reach = "so memory 0.05 is out of its reach; give a memory of at least"
    memory_full = ["--method", "full", "--memory", "0.05"]
    cases += [
        (["compress", "--model", w.model, "--context-file", str(w.context), *memory_full, "--out", str(tmp / "x.kvc")],
         full_out_of_reach),
        (["generate", "--model", w.model, "--context-file", str(w.context), "--question", "w1", *memory_full],
         full_out_of_reach),
    ]  # fmt: skip
    for cache, says in ((w.garbage, "is truncated"), (w.flipped, "checksum")):
        cases += [
            (["generate", "--model", w.model, "--cache", str(cache), "--question", "w1"], says),
            (["ask", "--model", w.model, "--cache", str(cache), "--questions", str(w.context)], says),
            (["chat", "--model", w.model, "--cache", str(cache)], says),
        ]
    return cases


def test_bad_input_is_one_line_and_status_2_for_every_command(world: World, tmp_path: Path, capsys) -> None:
    cases = bad_inputs(world, tmp_path)
    assert len(cases) > 50
    for argv, says in cases:
        code, _, err = call(capsys, argv)
        line = error_line(err, argv[0])
        assert code == 2 and says in line, (argv, err)
        assert not (tmp_path / "x.kvc").exists()


@pytest.mark.parametrize("fault", [KeyError("layer 3"), ValueError("slot 9 past the row's 8 entries")])
def test_a_fault_of_kvfold_is_an_internal_error_not_bad_input(world, tmp_path, capsys, monkeypatch, fault) -> None:
    """A KeyError or a plain ValueError from kvfold's own code (here the compression) is no fault of the
    input: one line that says it is an internal error and how to see its traceback, status 1, no file."""
    from kvfold.pipeline.context import PrefilledContext

    def broken(*args, **kwargs):
        raise fault

    monkeypatch.delenv("KVFOLD_DEBUG", raising=False)
    monkeypatch.setattr(PrefilledContext, "_compress", broken)
    code, _, err = call(capsys, world.compress(tmp_path / "x.kvc"))
    line = error_line(err, "compress")
    assert code == 1 and line.startswith(f"kvfold compress: internal error: {type(fault).__name__}: "), err
    assert "rerun with --debug, or KVFOLD_DEBUG=1, for the traceback" in line
    assert not (tmp_path / "x.kvc").exists()
    with pytest.raises(type(fault)):
        main([*world.compress(tmp_path / "x.kvc"), "--debug"])
    capsys.readouterr()


# ----------------------------------------------------------------------------- failed I/O


def writers(w: World, out: Path) -> dict[str, tuple[list[str], str | None, Path]]:
    """Every writing command aimed at ``out``: ``(argv, stdin, the path its message names)``."""
    talk = "w1 w2 w3\nw4 w5\n/save {}\nw6 w7\n"
    return {
        "compress": (w.compress(out / "doc.kvc"), None, out / "doc.kvc"),
        "eval": (w.sweep("eval", out / "run", w.small), None, out / "run"),
        "fidelity": (w.sweep("fidelity", out / "fid", w.small), None, out / "fid"),
        "bench": (w.bench(out / "bench"), None, out / "bench"),
        "bench --cachefile": (w.bench(out / "files", "--cachefile", "--turns", "0"), None, out / "files"),
        "mergemap": (w.mergemap(out / "mm"), None, out / "mm"),
        "chat /save": (w.chat(), talk.format(out / "talk.kvc"), out / "talk.kvc"),
    }


def denied_in(folder: Path, real: Callable) -> Callable:
    """``real`` (``os.open``, ``os.mkdir``), refusing any path inside ``folder`` as a folder's mode would."""

    def denied(path, *args, **kwargs):
        if str(path).startswith(f"{folder}{os.sep}"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    return denied


@pytest.mark.parametrize("place", ["under a file", "/proc", "permission denied"])
def test_an_unwritable_output_is_one_line_that_names_it(world, tmp_path, capsys, monkeypatch, place) -> None:
    out = {"under a file": world.a_file, "/proc": Path("/proc"), "permission denied": tmp_path / "locked"}[place]
    says = {
        "under a file": f"{world.a_file} is a file, not a folder; give a path whose folders are folders",
        "/proc": "No such file or directory; its folder does not exist or takes no new files",
        "permission denied": "Permission denied; permission denied: give a path in a folder you can write to",
    }[place]
    if place == "permission denied":
        out.mkdir()
        for function in ("open", "mkdir"):  # in a folder the user may not write to
            monkeypatch.setattr(os, function, denied_in(out, getattr(os, function)))
    for name, (argv, stdin, target) in writers(world, out).items():
        code, stdout, err = call(capsys, argv, stdin, monkeypatch)
        line = error_line(err, name.split()[0])
        assert code == 2 and f"error: cannot write {target}: {says}" in line, (name, err)
        if name == "chat /save":  # the conversation went on after the failed /save
            assert stdout.count("\n") == 3, stdout
    assert not (tmp_path / "locked").exists() or list((tmp_path / "locked").iterdir()) == []


@pytest.fixture
def disk_full(monkeypatch) -> Callable[[Path, str], None]:
    """``disk_full(folder, name)``: from now on, syncing ``name`` (or its temporary file) in ``folder`` fails
    with ENOSPC, as a write to a full disk does."""

    def install(folder: Path, name: str) -> None:
        real = os.fsync

        def fsync(fd: int) -> None:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if path.parent == folder and (path.name == name or path.name.startswith(f".{name}.")):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    return install


FULL = "No space left on device; the disk is full: free some space, or give a path on another disk, and run the same"


def test_a_full_disk_keeps_the_old_files_and_a_rerun_finishes(world, tmp_path, capsys, monkeypatch, disk_full) -> None:
    # compress over an older file
    doc = tmp_path / "doc.kvc"
    assert call(capsys, world.compress(doc, budget="0.25"))[0] == 0
    old = doc.read_bytes()
    disk_full(tmp_path, "doc.kvc")
    code, _, err = call(capsys, world.compress(doc))
    assert code == 2 and f"kvfold compress: error: cannot write {doc}: {FULL}" in error_line(err, "compress")
    assert doc.read_bytes() == old and temps(tmp_path) == []
    monkeypatch.undo()
    # a sweep whose results cannot be written: its answers are kept, the rerun redoes none
    for command, rows_file, results in (("eval", "predictions.jsonl", "results.json"),
                                        ("fidelity", "fidelity_samples.jsonl", "fidelity.json")):  # fmt: skip
        out = tmp_path / command
        disk_full(out, results)
        code, _, err = call(capsys, world.sweep(command, out, world.small))
        assert code == 2 and f"cannot write {out / results}: {FULL}" in error_line(err, command)
        monkeypatch.undo()
        rows = (out / rows_file).read_bytes()
        assert rows.count(b"\n") == 8 and not (out / results).exists() and not (out / LOCK_FILE).exists()
        assert_complete(out)
        assert call(capsys, world.sweep(command, out, world.small))[0] == 0
        assert (out / rows_file).read_bytes() == rows and temps(out) == []
        assert_complete(out)
    # mergemap over an older report
    out = tmp_path / "mm"
    assert call(capsys, world.mergemap(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk_full(out, "mergemap.png")
    code, _, err = call(capsys, world.mergemap(out))
    assert code == 2 and f"cannot write {out / 'mergemap.png'}: {FULL}" in error_line(err, "mergemap")
    assert (out / "mergemap.png").read_bytes() == before["mergemap.png"] and temps(out) == []
    assert_complete(out)
    monkeypatch.undo()
    # chat: the failed /save is one line, the conversation goes on, the older file stays
    talk = tmp_path / "talk.kvc"
    script = f"w1 w2\n/save {talk}\nw3 w4\n"
    assert call(capsys, world.chat(), script, monkeypatch)[0] == 0
    old = talk.read_bytes()
    disk_full(tmp_path, "talk.kvc")
    code, stdout, err = call(capsys, world.chat(), script, monkeypatch)
    line = error_line(err, "chat")
    assert code == 2 and f"cannot write {talk}: {FULL}" in line
    assert line.endswith("(the conversation goes on: /save elsewhere)")
    assert stdout.count("\n") == 2 and talk.read_bytes() == old  # both questions answered; the older file whole


def test_a_full_disk_in_a_bench_keeps_what_was_measured(world, tmp_path, capsys, monkeypatch, disk_full) -> None:
    out = tmp_path / "bench"
    disk_full(out, "records.jsonl")
    code, _, err = call(capsys, world.bench(out))
    assert code == 2 and f"cannot write {out / 'records.jsonl'}: {FULL}" in error_line(err, "bench")
    assert not (out / LOCK_FILE).exists() and temps(out) == []
    assert_complete(out)


# ----------------------------------------------------------------------------- interruption, two writers


def test_compress_to_proc_is_one_line_and_status_2(world: World, tmp_path: Path) -> None:
    proc = spawn([*world.compress(Path("/proc/x.kvc")), "--quiet"], tmp_path)  # --quiet: the error alone
    assert proc.wait() == 2
    assert proc.stderr == (
        "kvfold compress: error: cannot write /proc/x.kvc: No such file or directory; its folder does not exist or "
        "takes no new files: give a path in a folder you can write to\n"
    )


def test_a_second_sweep_on_one_folder_is_refused_and_ctrl_c_keeps_every_finished_answer(
    world: World, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    rows = out / "predictions.jsonl"
    first = spawn(world.sweep("eval", out), tmp_path / "first")
    wait_for(lambda: lines_in(rows) >= 1 or first.status() is not None, "the first answer")
    first.send(signal.SIGSTOP)  # the first sweep holds the folder, still
    before = rows.read_bytes()
    second = spawn(world.sweep("eval", out), tmp_path / "second")
    assert second.wait() == 2
    assert error_line(second.stderr, "eval") == (
        f"kvfold eval: error: {out} is in use by another kvfold (pid {first.pid}): wait for it to finish, or give "
        "another output folder"
    )
    assert rows.read_bytes() == before  # no row of the second
    first.send(signal.SIGINT)  # Ctrl-C while it is stopped, taken the moment it continues: on an idle
    first.send(signal.SIGCONT)  # machine the tiny sweep finished between one more answer and the signal
    assert first.wait() == 130
    kept = lines_in(rows)
    assert 1 <= kept < 2 * SAMPLES
    assert error_line(first.stderr, "eval") == (
        f"kvfold eval: interrupted; {kept} finished answers kept in {rows}: run the same command again to resume"
    )
    assert_complete(out) and not (out / LOCK_FILE).exists()
    finished = rows.read_bytes()
    assert call(capsys, world.sweep("eval", out))[0] == 0  # resumed: the rest answered, the kept ones not again
    keys = [eval_key(r) for r in read_jsonl(rows)]
    assert len(keys) == len(set(keys)) == 2 * SAMPLES and rows.read_bytes().startswith(finished)
    assert_complete(out)


def test_kill_9_in_the_middle_of_writing_the_results_leaves_no_half_file(world, forks, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    proc = forks.run(world.sweep("eval", out, world.small), pause=pause("write", "results.json", tmp_path))
    paused(proc, tmp_path)
    proc.send(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "results.json").exists()  # never half of it
    assert_complete(out)
    rows = (out / "predictions.jsonl").read_bytes()
    assert call(capsys, world.sweep("eval", out, world.small))[0] == 0
    assert (out / "predictions.jsonl").read_bytes() == rows  # no answer redone
    assert temps(out) == [] and not (out / LOCK_FILE).exists()  # the killed writer's temporary file removed
    assert_complete(out)


def test_ctrl_c_and_kill_9_in_the_middle_of_a_compress(world, forks, tmp_path, capsys) -> None:
    doc = tmp_path / "doc.kvc"
    assert call(capsys, world.compress(doc, budget="0.25"))[0] == 0
    old = doc.read_bytes()
    proc = forks.run(world.compress(doc), pause=pause("fsync", "doc.kvc", tmp_path))
    paused(proc, tmp_path)
    proc.send(signal.SIGINT)
    assert proc.wait() == 130 and error_line(proc.stderr, "compress") == "kvfold compress: interrupted"
    assert doc.read_bytes() == old and temps(tmp_path) == []
    proc = forks.run(world.compress(doc), pause=pause("fsync", "doc.kvc", tmp_path))
    paused(proc, tmp_path)
    proc.send(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert doc.read_bytes() == old and len(temps(tmp_path)) == 1  # the old file; the new one never renamed
    read_tensors(read_info(doc), verify=True)
    assert call(capsys, world.compress(doc))[0] == 0
    assert doc.read_bytes() != old and temps(tmp_path) == []  # the next save removes what the killed one left
    read_tensors(read_info(doc), verify=True)


def test_kill_9_in_the_middle_of_a_chat_save_keeps_the_saved_conversation(world, forks, tmp_path, capsys, monkeypatch):
    talk = tmp_path / "talk.kvc"
    script = f"w1 w2\nw3 w4\n/save {talk}\nw5 w6\n/save {talk}\n"
    proc = forks.run(world.chat(), stdin=script, pause=pause("fsync", "talk.kvc", tmp_path, skip=1))
    paused(proc, tmp_path)
    proc.send(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert proc.stdout.count(f"saved {talk}") == 1
    code, stdout, _ = call(capsys, ["chat", "--model", world.model, "--cache", talk], "/stats\n", monkeypatch)
    assert code == 0 and json.loads(stdout)["turns"] == 2  # the first /save, whole


def test_kill_9_then_ctrl_c_in_a_fidelity_run_then_resume(world, forks, tmp_path, capsys) -> None:
    out = tmp_path / "fid"
    rows = out / "fidelity_samples.jsonl"
    argv = world.sweep("fidelity", out, None, "--limit", "12")
    proc = forks.run(argv)
    wait_for(lambda: lines_in(rows) >= 1 or proc.status() is not None, "the first measurement")
    proc.send(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert_complete(out, torn_allowed=True)
    start = len(read_jsonl(rows))
    proc = forks.run(argv)
    wait_for(lambda: lines_in(rows) > start + 1 or proc.status() is not None, "more measurements")
    proc.send(signal.SIGINT)
    assert proc.wait() == 130
    kept = lines_in(rows)
    assert error_line(proc.stderr, "fidelity") == (
        f"kvfold fidelity: interrupted; {kept} finished measurements kept in {rows}: run the same command again to "
        "resume"
    )
    assert_complete(out)
    assert call(capsys, argv)[0] == 0
    keys = [(r["sample_id"], r["method"], r["budget"]) for r in read_jsonl(rows)]
    assert len(keys) == len(set(keys)) == 24
    assert_complete(out)


def test_ctrl_c_while_a_bench_measures(world, forks, tmp_path) -> None:
    out = tmp_path / "bench"
    proc = forks.run(world.bench(out))
    wait_for(lambda: (out / LOCK_FILE).exists() or proc.status() is not None, "the bench to hold its folder")
    time.sleep(0.3)  # inside the first measurement
    proc.send(signal.SIGINT)
    assert proc.wait() == 130
    assert error_line(proc.stderr, "bench") == (
        f"kvfold bench: interrupted; 0 finished configurations kept in {out / 'records.jsonl'}: run the same command "
        "again to resume"
    )
    assert not (out / LOCK_FILE).exists()
    assert_complete(out)


# ----------------------------------------------------------------------------- damaged results


def test_a_torn_last_row_is_redone_and_a_damaged_row_is_reported(world: World, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    rows = out / "predictions.jsonl"
    assert call(capsys, world.sweep("eval", out, world.small))[0] == 0
    whole = rows.read_bytes()
    lines = whole.splitlines(keepends=True)
    # a line edited by hand in the middle: reported by number, nothing overwritten
    damaged = b"".join([*lines[:2], b'{"sample_id": "s1", oops\n', *lines[2:]])
    rows.write_bytes(damaged)
    for command in (world.sweep("eval", out, world.small), ["report", out]):
        code, _, err = call(capsys, command)
        assert code == 2 and error_line(err, command[0]) == (
            f"kvfold {command[0]}: error: {rows} line 3 is not a prediction row (invalid JSON): the file was edited "
            "or damaged; correct or delete that line and run again (nothing was changed)"
        )
        assert rows.read_bytes() == damaged and not (out / LOCK_FILE).exists()
    # a crash in the middle of the last row: the row is dropped and redone
    torn = b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2]
    rows.write_bytes(torn)
    code, out_text, _ = call(capsys, ["report", out])
    assert code == 0 and "streamingllm" in out_text and rows.read_bytes() == torn  # report reads, changes nothing
    assert call(capsys, world.sweep("eval", out, world.small))[0] == 0
    again = read_jsonl(rows)
    assert [untimed(r) for r in again] == [untimed(json.loads(line)) for line in lines]
    assert_complete(out)
    # the results or the configuration edited into something that is not JSON
    (out / "results.json").write_text('{"records": ')
    code, _, err = call(capsys, ["report", out])
    assert code == 2 and f"error: {out / 'results.json'} is not valid JSON" in error_line(err, "report")
    (out / "run.json").write_text("{")
    code, _, err = call(capsys, world.sweep("eval", out, world.small))
    assert code == 2 and f"error: {out / 'run.json'} is not valid JSON" in error_line(err, "eval")


# ----------------------------------------------------------------------------- the kill -9 soak


def kill_moment(phase: str, proc: Proc, out: Path, rng: random.Random) -> None:
    """Wait for a random moment of ``phase``: just after the folder is taken, after 1-3 more answers,
    or once every answer is in (results, report and plots being written)."""
    rows = out / "predictions.jsonl"
    if phase == "start":
        wait_for(lambda: (out / LOCK_FILE).exists() or proc.status() is not None, "the folder taken")
        time.sleep(rng.uniform(0, 0.05))
    elif phase == "answers":
        goal = lines_in(rows) + rng.randint(1, 3)
        wait_for(lambda: lines_in(rows) >= goal or proc.status() is not None, "more answers")
        time.sleep(rng.uniform(0, 0.03))
    else:
        wait_for(lambda: lines_in(rows) >= 2 * SAMPLES or proc.status() is not None, "every answer")
        time.sleep(rng.uniform(0, 0.3))


def test_a_sweep_killed_ten_times_at_random_moments_ends_as_an_uninterrupted_one(world, forks, tmp_path) -> None:
    rng = random.Random(36)
    once = forks.run(world.sweep("eval", tmp_path / "once"))
    assert once.wait() == 0
    out = tmp_path / "killed"
    argv = world.sweep("eval", out)
    phases = ["start", *["answers"] * 7, "report", "report"]
    kills: list[str] = []
    while len(kills) < 10:
        proc = forks.run(argv)
        phase = phases[len(kills)]
        kill_moment(phase, proc, out, rng)
        proc.send(signal.SIGKILL)
        status = proc.wait()
        if status == -signal.SIGKILL:
            kills.append(f"{phase}: {lines_in(out / 'predictions.jsonl')} answers on disk")
        else:
            assert status == 0 and phase == "report"  # it finished first: another try
        assert_complete(out, torn_allowed=True)
    print("\nkill -9 soak:", "; ".join(kills))
    assert forks.run(argv).wait() == 0
    rows, expected = read_jsonl(out / "predictions.jsonl"), read_jsonl(tmp_path / "once" / "predictions.jsonl")
    keys = [eval_key(r) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * SAMPLES  # no answer missing, none twice
    assert sorted(map(untimed, rows), key=eval_key) == sorted(map(untimed, expected), key=eval_key)
    records = [json.loads((folder / "results.json").read_text())["records"] for folder in (out, tmp_path / "once")]
    assert list(map(untimed, records[0])) == list(map(untimed, records[1]))
    assert temps(out) == [] and not (out / LOCK_FILE).exists()
    assert_complete(out)
