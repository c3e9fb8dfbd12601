"""Stress check: cache files replaced and restored, fast, while ``kvfold serve`` answers requests on them.

Run in vLLM's environment (``make install-vllm``)::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_swaps.py \\
        --out runs/serve-swaps [--names 4] [--period 0.1] [--together] [--seconds 120] [--threads 16]

What it does: ``--names`` served names (``swap0.kvc`` …), name ``i`` a copy of one of two small files of
its own (a short text, the full cache, the secret code differing: ``code<N>.kvc``) and replaced by the
other, atomically, as a writer would: one name every ``--period`` seconds, in turn (every name each
``--period`` with ``--together``). Twice as many
contents as names, more than the worker keeps in memory (4) from 3 names on, so the worker reads files
again and again, and a load finds the file replaced since its request was checked: the load fails, and
vLLM ends that request with an error. vLLM schedules the next step before it has handled a step's
errors, so the request (or another on the same name) comes back in blocks the failed load never wrote,
while the file on disk may be the checked one again.

``--threads`` clients ask the code question on random names for ``--seconds``. Afterwards it checks that
the engine still answers (a plain request and one on a stable file), that every answer is one of its
name's two files' answers (asked alone first, on stable copies), and that every failure is an
OpenAI-style error of the kinds a replaced file may give: 500 (its load found it replaced since its
check) or 503 (replaced during each check); never 422, which says a file is damaged. It counts, from the
server's log, the loads that failed, the requests whose blocks did not hold their file, the requests the
pool kernel refused, and whether the engine died.

It writes ``swaps.json`` and ``swaps.md`` under ``--out`` (the server's logs beside them), and exits 1
when the engine died, an answer came from neither file, or a failure was of another kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integrations.vllm.conftest import Server, start_server  # noqa: E402 - the tests' server helpers

TEMPLATE = "The secret code of the archive is {}."
QUESTION = "What is the secret code of the archive?"
PREFIX = "The secret code of the archive is"


def numbers(names: int) -> list[str]:
    """The secret codes of the contents: ``2 · names`` of them, name ``i`` alternating ``2i`` and ``2i + 1``."""
    return [str(4821 + 1111 * k) for k in range(2 * names)]


SERVER_FLAGS = ("--kv-space", "0.055", "--max-model-len", "1024", "--", "--enforce-eager", "--max-num-seqs", "16")
LOG_PATTERNS = {
    "loads failed": r"not loaded: .*changed since the request was checked",
    "requests whose blocks did not hold their file": r"does not hold it \(its load failed\)",
    "requests the pool kernel refused": r"the pool kernel refused the requests",
    "requests vLLM failed for a load error": r"Failing \d+ request\(s\) due to KV load failure",
    "engine died": r"EngineDeadError|EngineCore encountered a fatal error|pool-attention kernel refused its arguments",
}


def make_files(folder: Path, codes: list[str]) -> dict[str, Path]:
    """The contents, as ``code<N>.kvc`` (the full cache of the text said four times)."""
    import kvfold

    model, tokenizer = kvfold.load_model()
    paths = {}
    for number in codes:
        text = " ".join([TEMPLATE.format(number)] * 4)
        paths[number] = folder / f"code{number}.kvc"
        if not paths[number].exists():
            context = kvfold.prefill(model, tokenizer, text)
            kvfold.save_context(context.compress("full", budget=1.0), paths[number], source_text=text)
    return paths


def ask(server: Server, name: str | None, question: str = QUESTION) -> tuple[int, dict]:
    extra = {"kv_transfer_params": {"kvfold_answer_prefix": PREFIX}} if name else {}
    try:
        return server.ask(name, question, max_tokens=4, **extra)
    except OSError as err:
        return 0, {"error": f"{type(err).__name__}: {err}"}


class Swapper(threading.Thread):
    """Replaces one name by its other content every ``period`` seconds, the names in turn, until stopped."""

    def __init__(self, folder: Path, pairs: dict[str, list[Path]], period: float, together: bool = False) -> None:
        super().__init__(daemon=True)
        self.folder, self.pairs, self.period, self.together = folder, pairs, period, together
        self.stop = threading.Event()
        self.swaps = 0

    def run(self) -> None:
        names = list(self.pairs)
        while not self.stop.wait(self.period):
            for _ in range(len(names) if self.together else 1):
                name = names[self.swaps % len(names)]
                temporary = self.folder / f".{name}.tmp"
                shutil.copyfile(self.pairs[name][self.swaps // len(names) % 2 == 0], temporary)  # the other one
                os.replace(temporary, self.folder / f"{name}.kvc")
                self.swaps += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--period", type=float, default=0.1)
    parser.add_argument("--together", action="store_true", help="replace every name each period")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out
    caches = out / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    codes = numbers(args.names)
    sources = make_files(caches, codes)
    names = [f"swap{i}" for i in range(args.names)]
    pairs = {name: [sources[codes[2 * i]], sources[codes[2 * i + 1]]] for i, name in enumerate(names)}
    for name, pair in pairs.items():
        shutil.copyfile(pair[0], caches / f"{name}.kvc")
    server = start_server(caches, out, *SERVER_FLAGS)
    try:
        server.wait()
        expected = {}
        for number in codes:  # asked alone, on the stable copies
            status, body = ask(server, f"code{number}")
            if status != 200:
                raise SystemExit(f"the reference request on code{number} failed ({status}): {body}")
            expected[number] = list(body["choices"][0]["token_ids"])
        answers = {name: [expected[codes[2 * i]], expected[codes[2 * i + 1]]] for i, name in enumerate(names)}
        if any(pair[0] == pair[1] for pair in answers.values()):
            raise SystemExit("a name's two files answer the same: the check could not tell them apart")
        outcomes: list[tuple[int, str]] = []
        lock = threading.Lock()
        deadline = time.monotonic() + args.seconds
        swapper = Swapper(caches, pairs, args.period, args.together)

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                name = rng.choice(names)
                status, body = ask(server, name)
                if status == 200:
                    right = body["choices"][0]["token_ids"] in answers[name]
                    kind = "answered" if right else "answered from neither file"
                elif status == 0:
                    kind = "no answer (connection refused or closed)"
                    time.sleep(0.5)  # the server is gone: do not spin
                else:
                    kind = f"error {status}" + ("" if "error" in body or "message" in body else " (not OpenAI-style)")
                with lock:
                    outcomes.append((status, kind))

        swapper.start()
        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(args.seed * 1000 + i,)) for i in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        swapper.stop.set()
        swapper.join()
        elapsed = time.monotonic() - started
        after = {"plain": ask(server, None, "Name three colours.")[0], "stable file": ask(server, f"code{codes[0]}")[0]}
    finally:
        server.stop()
    log = server.vllm_log.read_text(errors="replace")  # the whole log (kvfold serve's own repeats part of it)
    counts = {what: len(re.findall(pattern, log)) for what, pattern in LOG_PATTERNS.items()}
    kinds = Counter(kind for _, kind in outcomes)
    report = {
        "names": args.names,
        "period s": args.period,
        "together": args.together,
        "seconds": round(elapsed, 1),
        "threads": args.threads,
        "swaps": swapper.swaps,
        "requests": len(outcomes),
        "outcomes": dict(sorted(kinds.items())),
        "after the load, status": after,
        "from the server's log": counts,
    }
    died = counts["engine died"] > 0 or after != {"plain": 200, "stable file": 200}
    wrong = sum(count for kind, count in kinds.items() if kind not in ("answered", "error 500", "error 503"))
    report["verdict"] = "engine died" if died else ("wrong answers or errors" if wrong else "held")
    (out / "swaps.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# File swaps under load", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {json.dumps(value) if isinstance(value, dict) else value} |" for key, value in report.items()]
    (out / "swaps.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if died or wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
