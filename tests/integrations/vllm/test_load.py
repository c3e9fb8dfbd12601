"""``kvfold serve`` under load, on 127.0.0.1, in a server of its own with a small KV space.

* More requests on one long cache than the KV space holds: vLLM preempts some (its
  ``vllm:num_preemptions_total`` counter rises), and every answer is still ``kvfold ask``'s.
* Plain requests that fill the KV space after requests on quantized files (so some get a block that
  held a file's codes) answer as they did alone.
* The load: 16 client threads send a fixed, seeded mix of requests (on cached files, plain, an unknown
  name, a damaged file, malformed JSON, a prompt longer than the context, streams the client hangs up
  on), while a served file is replaced by another valid file and restored, again and again; then the
  server is killed with SIGKILL in the middle of an answer, started again, and the mix goes on.
  Afterwards: every answer equals the one the same request got alone (asked one at a time first), every
  failure is an OpenAI-style error with the status of its kind, and the server's memory (the RSS of its
  processes) is back near where it was after warm-up. The figures go to ``load.json`` in the test's
  folder and to stdout (``pytest -s``).

Every request goes to 127.0.0.1; the loops are bounded in count and in time.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kvfold.evaluate.data.logbook import FACTS
from tests.integrations.vllm.conftest import PAIR, Server, start_server

KV_GIB = 0.055
"""The small server's KV space: 40 blocks of 32 tokens (1.47 MB a block: SmolLM2 in float32). Requests on
``kvzip``'s file share the blocks that hold the file (prefix caching, ~6); 15 of them, each with a
question and 48 new tokens (3 blocks of its own), need ~51."""
MAX_MODEL_LEN = 1024
SERVER_FLAGS = ("--kv-space", str(KV_GIB), "--max-model-len", str(MAX_MODEL_LEN))
VLLM_FLAGS = ("--", "--enforce-eager", "--max-num-seqs", "16")
THREADS = 16
PHASES = (120, 80)
"""Requests before the kill, and after the restart."""
LOAD_TOKENS = 8
LOAD_SECONDS = 420
"""The most the load may take, both phases (each request also times out)."""
REQUEST_SECONDS = 180
RSS_TOLERANCE = (0.10, 256 << 20)
"""The server's memory after the load may exceed the one after warm-up by this share or these bytes,
whichever is more."""
QUESTIONS = [q for _, q, _ in FACTS[:3]]
CODE_QUESTION = "What is the secret code of the archive?"
CODE_PREFIX = "The secret code of the archive is"
"""The answer prefix of :data:`CODE_QUESTION` (``kvfold_answer_prefix``): the few tokens asked for are
the code's digits, which tell the pair's files apart."""
PLAIN = ["Name three colours.", "What is the capital of France?", "Count from one to five."]
KINDS = {
    "cached": 30,
    "plain": 14,
    "swapped": 16,
    "unknown": 8,
    "damaged": 8,
    "malformed": 8,
    "oversized": 8,
    "hangup": 8,
}
"""Each kind's weight in the mix."""
EXPECTED_STATUS = {"unknown": 404, "damaged": 422, "malformed": 400, "oversized": 400}


@pytest.fixture(scope="module")
def load_caches(saved, tmp_path_factory) -> Path:
    """The small server's folder: copies of the session's files, a damaged one, and ``swap`` (the pair's
    first file, replaced by the second and back during the load)."""
    folder = tmp_path_factory.mktemp("load-caches")
    for name in ("uniform", "kvzip", "mem16", "mem32", "mem64", f"code{PAIR[1][0]}", f"code{PAIR[1][1]}"):
        shutil.copyfile(saved[name], folder / f"{name}.kvc")
    shutil.copyfile(saved[f"code{PAIR[1][0]}"], folder / "swap.kvc")
    data = bytearray(saved["uniform"].read_bytes())
    data[-100] ^= 0xFF
    (folder / "damaged.kvc").write_bytes(bytes(data))
    return folder


@pytest.fixture(scope="module")
def small(load_caches, tmp_path_factory):
    """``kvfold serve`` with a KV space of 40 blocks (started for this module, stopped after it)."""
    handle = start_server(load_caches, tmp_path_factory.mktemp("small-server"), *SERVER_FLAGS, *VLLM_FLAGS)
    try:
        handle.wait()
        yield handle
    finally:
        handle.stop()


def test_requests_beyond_the_kv_space_wait_or_are_preempted_and_still_answer_right(small, references):
    """15 requests on ``kvzip``'s file at once, 48 new tokens each, in a KV space of 40 blocks: vLLM
    preempts some (its counter rises); a preempted one reloads its file, and every answer stays kvfold's."""
    before = small.metric("vllm:num_preemptions_total")
    questions = [q for _, q, _ in FACTS] * 3
    with ThreadPoolExecutor(len(questions)) as pool:
        results = list(pool.map(lambda q: (q, small.ask("kvzip", q, max_tokens=48, ignore_eos=True)), questions))
    for question, (status, body) in results:
        assert status == 200, body
        ids = body["choices"][0]["token_ids"]
        assert ids[: len(references["kvzip"][question])] == references["kvzip"][question]
    assert small.metric("vllm:num_preemptions_total") > before, small.tails()


def test_plain_requests_in_blocks_that_held_quantized_files_answer_as_alone(small):
    """A file's codes read as floats hold NaNs; a plain request given such a block must not read them
    (the connector zeroes the block first). Plain requests asked alone, then quantized files loaded,
    then the same requests, three of each at once, fill every block of the KV space."""
    questions = [f"Write one sentence about the number {i} and the sea." for i in range(6)]

    def ask(question: str) -> list[int]:
        status, body = small.ask(None, question, max_tokens=48, ignore_eos=True)
        assert status == 200, body
        return _answer(body)

    alone = {q: ask(q) for q in questions}
    for name in ("mem16", "mem32", "mem64"):  # their codes written into blocks, then freed
        status, body = small.ask(name, QUESTIONS[0], max_tokens=4)
        assert status == 200, body
    with ThreadPoolExecutor(3 * len(questions)) as pool:
        answers = list(pool.map(lambda q: (q, ask(q)), questions * 3))
    wrong = [(q, a) for q, a in answers if a != alone[q]]
    assert not wrong, f"{len(wrong)} of {len(answers)} plain answers changed: {wrong[:2]}; {small.tails()}"


# ---------------------------------------------------------------------------- the load
@dataclass
class Outcome:
    """One request of the load: what was sent and what came back."""

    index: int
    kind: str
    key: tuple
    status: int | None = None
    body: dict | None = None
    seconds: float = 0.0
    error: str | None = None
    chunks: int = 0
    phase: int = 0
    notes: list[str] = field(default_factory=list)


def _payload(kind: str, key: tuple) -> bytes:
    """The request body of one request of ``kind``."""
    if kind == "malformed":
        return b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}'
    body = {"model": "smollm2-135m", "max_tokens": LOAD_TOKENS, "temperature": 0, "return_token_ids": True}
    if kind == "oversized":
        body["messages"] = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 200)}]
        return json.dumps(body).encode()
    cache, question = key
    body["messages"] = [{"role": "user", "content": question}]
    if cache is not None:
        body["kv_transfer_params"] = _params(cache, question)
    if kind == "hangup":
        body.update(stream=True, max_tokens=64, ignore_eos=True)
    return json.dumps(body).encode()


def _params(cache: str, question: str) -> dict:
    """The ``kv_transfer_params`` of a request on ``cache``."""
    params = {"kvfold_cache": cache}
    if question == CODE_QUESTION:
        params["kvfold_answer_prefix"] = CODE_PREFIX
    return params


def _send(url: str, outcome: Outcome, deadline: float) -> Outcome:
    """Send one request (none after ``deadline``); a hang-up closes the stream after its first chunk."""
    if time.monotonic() > deadline:
        outcome.error = "not sent: the load ran out of time"
        return outcome
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=REQUEST_SECONDS)
    start = time.monotonic()
    try:
        body = _payload(outcome.kind, outcome.key)
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        outcome.status = response.status
        if outcome.kind == "hangup" and response.status == 200:
            while outcome.chunks < 1:
                line = response.fp.readline()
                if not line:
                    break
                outcome.chunks += line.startswith(b"data: {")
            connection.sock.close()  # the client leaves in the middle of the answer
        else:
            raw = response.read()
            outcome.body = json.loads(raw) if raw else None
    except (OSError, http.client.HTTPException, ValueError) as err:
        outcome.error = f"{type(err).__name__}: {err}"
    finally:
        outcome.seconds = time.monotonic() - start
        connection.close()
    return outcome


def _plan(count: int, rng: random.Random, start: int) -> list[Outcome]:
    kinds, weights = zip(*KINDS.items(), strict=True)
    out = []
    for index in range(start, start + count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "cached":
            key = (rng.choice(["uniform", f"code{PAIR[1][0]}"]), rng.choice(QUESTIONS + [CODE_QUESTION]))
        elif kind == "plain":
            key = (None, rng.choice(PLAIN))
        elif kind == "swapped":
            key = ("swap", CODE_QUESTION)
        elif kind == "unknown":
            key = ("no-such-cache", QUESTIONS[0])
        elif kind == "damaged":
            key = ("damaged", QUESTIONS[0])
        elif kind == "hangup":
            key = ("uniform", QUESTIONS[1])
        else:
            key = (None, "")
        out.append(Outcome(index=index, kind=kind, key=key))
    return out


def _answer(body: dict) -> list[int]:
    return list(body["choices"][0]["token_ids"])


def _references(server: Server) -> dict[tuple, list[int]]:
    """The answer of every distinct request of the mix, asked alone, one at a time."""
    keys = [(c, q) for c in ("uniform", f"code{PAIR[1][0]}") for q in QUESTIONS + [CODE_QUESTION]]
    keys += [(None, q) for q in PLAIN] + [(f"code{n}", CODE_QUESTION) for n in PAIR[1]]
    out = {}
    for cache, question in keys:
        extra = {} if cache is None else {"kv_transfer_params": _params(cache, question)}
        status, body = server.ask(cache, question, max_tokens=LOAD_TOKENS, **extra)
        assert status == 200, body
        out[(cache, question)] = _answer(body)
    return out


def _group_rss(pgid: int) -> int:
    """Bytes of resident memory of every process in group ``pgid`` (the server's, from ``/proc``)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) << 10
        except (OSError, ValueError, IndexError):
            continue
    return total


def _settled_rss(server: Server, seconds: float = 4) -> int:
    time.sleep(seconds)
    return _group_rss(server.process.pid)


class _Swapper(threading.Thread):
    """Replaces ``swap.kvc`` by the pair's second file and back (atomically, as a writer would), until
    stopped, at most ``rounds`` times."""

    def __init__(self, folder: Path, rounds: int = 40, period: float = 0.7) -> None:
        super().__init__(daemon=True)
        self.folder, self.rounds, self.period = folder, rounds, period
        self.stop = threading.Event()
        self.swaps = 0
        first, second = (folder / f"code{n}.kvc" for n in PAIR[1])
        self.sources = (second, first)

    def run(self) -> None:
        for i in range(self.rounds):
            if self.stop.wait(self.period):
                break
            self._place(self.sources[i % 2])
            self.swaps += 1
        self._place(self.sources[1])  # restored

    def _place(self, source: Path) -> None:
        temporary = self.folder / ".swap.tmp"
        shutil.copyfile(source, temporary)
        os.replace(temporary, self.folder / "swap.kvc")


def _run_phase(server: Server, plan: list[Outcome], deadline: float, folder: Path, phase: int) -> int:
    swapper = _Swapper(folder)
    swapper.start()
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda o: _send(server.url, o, deadline), plan))
    finally:
        swapper.stop.set()
        swapper.join()
    for outcome in plan:
        outcome.phase = phase
    return swapper.swaps


def _kill_in_the_middle_of_an_answer(server: Server) -> Outcome:
    """A long answer in flight, then SIGKILL to every process of the server."""
    victim = Outcome(index=-1, kind="killed", key=("uniform", QUESTIONS[2]))
    payload = json.loads(_payload("cached", victim.key))
    payload.update(max_tokens=400, ignore_eos=True)
    result: dict = {}

    def ask() -> None:
        try:
            result["response"] = server.request("/v1/chat/completions", payload, timeout=60)
        except OSError as err:
            result["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(1.5)  # decoding by now (400 tokens take far longer)
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    thread.join(timeout=60)
    victim.error = result.get("error")
    victim.status = result.get("response", (None,))[0]
    return victim


def _check(outcome: Outcome, references: dict[tuple, list[int]], swap_answers: list[list[int]]) -> str | None:
    """What is wrong with one request's outcome (None: nothing)."""
    if outcome.error:
        return outcome.error
    kind, status, body = outcome.kind, outcome.status, outcome.body
    if kind == "hangup":
        return None if status == 200 and outcome.chunks >= 1 else f"stream: status {status}, {outcome.chunks} chunks"
    if status == 200:
        if kind not in ("cached", "plain", "swapped"):
            return f"status 200 for a {kind} request"
        answer = _answer(body)
        if kind == "swapped":
            return None if answer in swap_answers else f"an answer from neither file: {answer}"
        return None if answer == references[outcome.key] else f"answer {answer} != alone {references[outcome.key]}"
    error = (body or {}).get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or "\n" in error["message"]:
        return f"status {status} without a one-line OpenAI error: {body}"
    if error.get("code") not in (status, None) or not error.get("type"):
        return f"status {status} with error {error}"
    if kind in EXPECTED_STATUS:
        return None if status == EXPECTED_STATUS[kind] else f"status {status}, expected {EXPECTED_STATUS[kind]}"
    if kind == "swapped" and status == 500:
        return None  # the file changed between its check and its load: the request fails, whole
    if kind == "swapped" and status == 503:
        return None  # the file was replaced during each of the catalog's checks: ask again (never 422, "damaged")
    return f"status {status} for a {kind} request: {error['message']}"


def test_the_server_under_load(small, load_caches, tmp_path):
    rng = random.Random(0)
    references = _references(small)
    swap_answers = [references[(f"code{n}", CODE_QUESTION)] for n in PAIR[1]]
    assert swap_answers[0] != swap_answers[1]
    warm = _plan(len(KINDS), random.Random(1), start=-100)  # warm-up, then the memory
    _run_phase(small, warm, time.monotonic() + 120, load_caches, phase=0)
    rss = {"phase 1 after warm-up": _settled_rss(small)}
    deadline = time.monotonic() + LOAD_SECONDS

    first = _plan(PHASES[0], rng, start=0)
    swaps = _run_phase(small, first, deadline, load_caches, phase=1)
    rss["phase 1 after the load"] = _settled_rss(small)
    victim = _kill_in_the_middle_of_an_answer(small)

    restart = time.monotonic()
    port = urlparse(small.url).port
    again = start_server(load_caches, small.log.parent, *SERVER_FLAGS, *VLLM_FLAGS, port=port)
    small.process, small.command = again.process, again.command  # the module fixture stops this one
    small.wait()
    restart = time.monotonic() - restart
    warm2 = _plan(len(KINDS), random.Random(2), start=-200)
    _run_phase(small, warm2, time.monotonic() + 120, load_caches, phase=0)
    rss["phase 2 after warm-up"] = _settled_rss(small)
    second = _plan(PHASES[1], rng, start=PHASES[0])
    swaps += _run_phase(small, second, deadline, load_caches, phase=2)
    rss["phase 2 after the load"] = _settled_rss(small)

    outcomes = warm + first + warm2 + second
    problems = {o.index: p for o in outcomes if (p := _check(o, references, swap_answers)) is not None}
    latencies = sorted(o.seconds for o in first + second if o.status == 200 and o.kind != "hangup")
    figures = {
        "requests": len(first) + len(second),
        "warm-up requests": len(warm) + len(warm2),
        "threads": THREADS,
        "by kind": {k: sum(o.kind == k for o in first + second) for k in KINDS},
        "answered 200": sum(o.status == 200 for o in first + second),
        "errors by status": _count(f"{o.kind} {o.status}" for o in first + second if o.status not in (200, None)),
        "an error of each": {
            f"{o.kind} {o.status}": o.body["error"]["message"][:160]
            for o in reversed(first + second)
            if o.status not in (200, None) and isinstance(o.body, dict) and isinstance(o.body.get("error"), dict)
        },
        "swapped answered from": {
            "first file": sum(_answered(o, swap_answers[0]) for o in first + second),
            "second file": sum(_answered(o, swap_answers[1]) for o in first + second),
        },
        "file swaps": swaps,
        "latency p50 s": round(statistics.median(latencies), 3),
        "latency p99 s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "killed request": victim.error or victim.status,
        "restart s": round(restart, 1),
        "rss MiB": {k: round(v / 2**20) for k, v in rss.items()},
        "problems": problems,
    }
    report = tmp_path / "load.json"
    report.write_text(json.dumps(figures, indent=2))
    print(f"\nkvfold serve under load ({report}):\n{json.dumps(figures, indent=2)}")

    assert not problems, problems
    assert victim.status is None, "the killed server still answered"
    assert swaps >= 2
    for phase in (1, 2):
        before, after = rss[f"phase {phase} after warm-up"], rss[f"phase {phase} after the load"]
        assert after <= before + max(RSS_TOLERANCE[0] * before, RSS_TOLERANCE[1]), rss


def _answered(outcome: Outcome, answer: list[int]) -> bool:
    return outcome.kind == "swapped" and outcome.status == 200 and _answer(outcome.body) == answer


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))
