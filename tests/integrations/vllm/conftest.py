"""One vLLM server (``kvfold serve``) and one folder of caches for every test of the plugin.

The caches are made once per session on a short logbook (:func:`build_logbook` at
:data:`LOGBOOK_TOKENS`), with the methods the issue names at keep 0.1; the references are
``kvfold ask``'s answers from the same files (:func:`kvfold.load_context`). The shared server
starts with no memory flag while another process holds :data:`HELD_GIB` GiB; ``test_load.py``
starts servers of its own (:func:`start_server`) with a small KV space.
These tests run in the environment that has vLLM (``make install-vllm``; ``make test`` runs them
there after the main suite).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold.evaluate.data.logbook import FACTS, build_logbook

LOGBOOK_TOKENS = 1500
METHODS = {
    "am_fit": "kvzip+am_fit",
    "kvzip": "kvzip",
    "adakv": "adakv:snapkv",
    "uniform": "kvzip[layerwise=true]+am_fit",
}
"""Cache name → method, each at keep 0.1 of the logbook. KVzip ranks all layers and heads at once, so
its longest row nears the context (vLLM pads every row to it); ``uniform`` keeps equal counts a head."""
BUDGET = 0.1
MEMORY = {"mem16": 1 / 16, "mem32": 1 / 32, "mem64": 1 / 64}
"""Cache name → the fraction of the 16-bit full cache's bytes ``kvzip+am_fit`` keeps (``--memory``: 4 bits
at 1/16 and 1/32, 3 bits at 1/64)."""
SERVED = (*METHODS, *MEMORY)
"""Every compressed file the tests serve."""
ANSWER_TOKENS = 24
PAIR = ("The secret code of the archive is {}.", ("4821", "7395"))
"""Two short contexts of the same length that differ in one number (prefix-cache mixing)."""
START_SECONDS = 600
LOGPROB_TOLERANCE = 2e-3
"""Largest difference allowed between vLLM's and kvfold's log-probabilities (float32 both). Measured
differences are ~1e-4: the two sum attention in another order, vLLM's RoPE table and the turn of the
question's queries by T − P (float64, then float32) each move a logit by a few float32 ulps of
values up to ~30; 2e-3 is 10× the largest seen and 100× below the gap between a greedy token and the
runner-up that these answers need to stay the same."""


def worst_logprob_difference(steps: list[dict], log_probs: torch.Tensor) -> float:
    """The largest difference between vLLM's top log-probabilities (``logprobs.content`` of a response
    asked with ``return_tokens_as_token_ids``) and ``log_probs`` (one row of kvfold's a step)."""
    worst = 0.0
    for step, row in zip(steps, log_probs, strict=True):
        for top in step["top_logprobs"]:
            token = int(top["token"].removeprefix("token_id:"))
            if math.isfinite(top["logprob"]):
                worst = max(worst, abs(top["logprob"] - float(row[token])))
    return worst


@torch.inference_mode()
def stock_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens of plain transformers (its own cache and attention), EOS not special."""
    out, past, step = [], None, ids
    for _ in range(steps):
        result = model(step, past_key_values=past, use_cache=True)
        past = result.past_key_values
        out.append(int(result.logits[0, -1].argmax()))
        step = torch.tensor([[out[-1]]])
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVE_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
HELD_GIB = 3
"""GiB another process holds while the shared server starts (it must size its KV space around them)."""


class Server:
    """A running ``kvfold serve`` and helpers to call it.

    Attributes:
        url: its address.
        process: the ``kvfold serve`` process (the supervisor; vLLM runs in its process group).
        log: ``kvfold serve``'s own output (its announcements, then vLLM's once ready).
        vllm_log: the server's whole log (``--log``).
        command: the command that started it.
    """

    def __init__(self, url: str, process: subprocess.Popen, log: Path, vllm_log: Path, command: list[str]) -> None:
        self.url, self.process, self.log, self.vllm_log, self.command = url, process, log, vllm_log, command
        self.held_rss = 0

    def request(self, path: str, payload: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def ask(self, cache: str | None, question: str, max_tokens: int = ANSWER_TOKENS, **extra) -> tuple[int, dict]:
        payload = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        if cache is not None:
            payload["kv_transfer_params"] = {"kvfold_cache": cache, **payload.get("kv_transfer_params", {})}
        return self.request("/v1/chat/completions", payload)

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter or gauge of vLLM's ``/metrics`` over its labels."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def tails(self) -> str:
        """The last lines of both logs, for a failure's message."""
        out = []
        for path in (self.log, self.vllm_log):
            if path.exists():
                out.append(f"--- {path}:\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def wait(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvfold serve exited ({self.process.returncode}):\n{self.tails()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        raise RuntimeError(f"kvfold serve did not start in {START_SECONDS}s:\n{self.tails()}")

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """End the server and every process of its group (SIGKILL after a minute)."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        _wait_group_gone(self.process.pid)


def _wait_group_gone(pgid: int, seconds: float = 30) -> None:
    """Wait until no process of group ``pgid`` is left (the engine after its API server), else SIGKILL."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def start_server(
    caches: Path, folder: Path, *flags: str, port: int | None = None, env: dict[str, str] | None = None
) -> Server:
    """Start ``kvfold serve`` over ``caches`` (not waiting for it): its logs in ``folder``, ``flags`` after
    the caches (e.g. ``--kv-space``, ``--`` and vLLM's own), ``env`` added to its environment."""
    port = port or _free_port()
    log, vllm_log = folder / "serve.log", folder / "vllm.log"
    command = [str(Path(sys.executable).with_name("kvfold")), "serve", "--caches", str(caches), "--port", str(port)]
    command += ["--log", str(vllm_log), *flags]
    with log.open("a") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **SERVE_ENV, **(env or {})),
            start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", process, log, vllm_log, command)


HOLD_SCRIPT = (
    "import sys, time\n"
    "held = bytearray(int(sys.argv[1]) << 30)\n"
    "for i in range(0, len(held), 4096):\n"
    "    held[i] = 1\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def hold_memory(gib: int, seconds: float = 900) -> subprocess.Popen:
    """A process that holds ``gib`` GiB of touched memory (for at most ``seconds``), once it says so."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT, str(gib), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture(scope="session")
def caches(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("caches")


@pytest.fixture(scope="session")
def server(caches, tmp_path_factory):
    """``kvfold serve`` over :func:`caches` with no memory flag, started while another process holds
    :data:`HELD_GIB` GiB (it sizes its KV space from the free memory); the caches are read per request."""
    holder = hold_memory(HELD_GIB)
    try:
        handle = start_server(
            caches, tmp_path_factory.mktemp("server"), "--", "--enforce-eager", "--max-num-seqs", "16"
        )
        handle.held_rss = _rss_kib(holder.pid) << 10
        try:
            handle.wait()
        except BaseException:
            handle.stop()
            raise
    finally:
        holder.kill()
        holder.wait()
    yield handle
    handle.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture(scope="session")
def model_and_tokenizer():
    torch.set_num_threads(1)
    return kvfold.load_model()


@pytest.fixture(scope="session")
def logbook(model_and_tokenizer) -> str:
    return build_logbook(model_and_tokenizer[1], LOGBOOK_TOKENS)


@pytest.fixture(scope="session")
def saved(caches, model_and_tokenizer, logbook) -> dict[str, Path]:
    """Every cache the tests serve, written once: the methods at keep 0.1, a full cache, and the pair."""
    model, tokenizer = model_and_tokenizer
    paths = {}
    context = kvfold.prefill(model, tokenizer, logbook, methods=list(METHODS.values()))
    for name, method in METHODS.items():
        paths[name] = caches / f"{name}.kvc"
        kvfold.save_context(context.compress(method, budget=BUDGET), paths[name], source_text=logbook)
    for name, memory in MEMORY.items():
        paths[name] = caches / f"{name}.kvc"
        kvfold.save_context(context.compress(METHODS["am_fit"], memory=memory), paths[name], source_text=logbook)
    template, numbers = PAIR
    for number in numbers:
        text = " ".join([template.format(number)] * 4)
        paths[f"code{number}"] = caches / f"code{number}.kvc"
        short = kvfold.prefill(model, tokenizer, text)
        kvfold.save_context(short.compress("full", budget=1.0), paths[f"code{number}"], source_text=text)
    return paths


@pytest.fixture(scope="session")
def references(saved, model_and_tokenizer) -> dict[str, dict[str, list[int]]]:
    """``kvfold ask``'s greedy answers (token ids) from each method's file, per question."""
    model, tokenizer = model_and_tokenizer
    out = {}
    for name in SERVED:
        context = kvfold.load_context(saved[name], model, tokenizer)
        out[name] = {q: context.generate(q, max_new_tokens=ANSWER_TOKENS)[0].token_ids for _, q, _ in FACTS}
    return out


@pytest.fixture
def scratch_cache(caches, saved):
    """A name in the served folder that a test fills and the fixture removes."""
    made: list[Path] = []

    def make(name: str, source: Path | None = None) -> Path:
        path = caches / f"{name}.kvc"
        if source is not None:
            shutil.copyfile(source, path)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)
