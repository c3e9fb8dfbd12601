"""One vLLM server (``kvfold serve``) and one folder of caches for every test of the plugin.

The caches are made once per session on a short logbook (:func:`build_logbook` at
:data:`LOGBOOK_TOKENS`), with the methods the issue names at keep 0.1, while the server starts;
the references are ``kvfold ask``'s answers from the same files (:func:`kvfold.load_context`).
These tests run in the environment that has vLLM (``make install-vllm``; ``make test`` runs them
there after the main suite).
"""

from __future__ import annotations

import json
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
ANSWER_TOKENS = 24
PAIR = ("The secret code of the archive is {}.", ("4821", "7395"))
"""Two short contexts of the same length that differ in one number (prefix-cache mixing)."""
START_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """The running ``kvfold serve`` and helpers to call it."""

    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url, self.process, self.log = url, process, log

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

    def wait(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvfold serve exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        raise RuntimeError(f"kvfold serve did not start in {START_SECONDS}s:\n{self.log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def caches(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("caches")


@pytest.fixture(scope="session")
def server(caches, tmp_path_factory):
    """``kvfold serve`` over :func:`caches`, started before the caches are written (they are read per request)."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", VLLM_CPU_OMP_THREADS_BIND="nobind")
    kvfold_command = [str(Path(sys.executable).with_name("kvfold"))]
    command = kvfold_command + ["serve", "--caches", str(caches), "--port", str(port), "--kv-space", "1"]
    command += ["--", "--enforce-eager", "--max-num-seqs", "16"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    handle = Server(f"http://127.0.0.1:{port}", process, log)
    yield handle
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def model_and_tokenizer():
    torch.set_num_threads(1)
    return kvfold.load_model()


@pytest.fixture(scope="session")
def logbook(model_and_tokenizer) -> str:
    return build_logbook(model_and_tokenizer[1], LOGBOOK_TOKENS)


@pytest.fixture(scope="session")
def saved(server, caches, model_and_tokenizer, logbook) -> dict[str, Path]:
    """Every cache the tests serve, written once: the methods at keep 0.1, a full cache, and the pair."""
    model, tokenizer = model_and_tokenizer
    paths = {}
    context = kvfold.prefill(model, tokenizer, logbook, methods=list(METHODS.values()))
    for name, method in METHODS.items():
        paths[name] = caches / f"{name}.kvc"
        kvfold.save_context(context.compress(method, budget=BUDGET), paths[name], source_text=logbook)
    template, numbers = PAIR
    for number in numbers:
        text = " ".join([template.format(number)] * 4)
        paths[f"code{number}"] = caches / f"code{number}.kvc"
        short = kvfold.prefill(model, tokenizer, text)
        kvfold.save_context(short.compress("full", budget=1.0), paths[f"code{number}"], source_text=text)
    server.wait()
    return paths


@pytest.fixture(scope="session")
def references(saved, model_and_tokenizer) -> dict[str, dict[str, list[int]]]:
    """``kvfold ask``'s greedy answers (token ids) from each method's file, per question."""
    model, tokenizer = model_and_tokenizer
    out = {}
    for name in METHODS:
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
