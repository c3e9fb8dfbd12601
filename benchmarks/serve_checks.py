"""What requests on files wait for while ``kvfold serve`` checks files it has not seen.

Run in vLLM's environment (``make install-vllm``), alone on the machine::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_checks.py \\
        --cache FILE.kvc [--new 24] [--repeat 3] [--http] --out runs/serve-checks

The first request on a file waits for the API server's check of it (``CacheCatalog``: the file read and
checked against the model, its blocks planned); the verdict is kept, and later requests on the file
only look at its inode, size and time. Checks run in the API server's threads, one file at a time.

* **The catalog** (always): ``--new`` copies of ``--cache``, new to a warm catalog (the model loaded, a
  known copy checked), checked from the threads of a pool of asyncio's default size (where ``kvfold
  serve`` runs them), all submitted at once, ``--repeat`` times; meanwhile another thread checks the
  known copy again and again, as requests on a known file keep coming. It reports the time until all
  are checked and how long the known file's checks took then.
* **Through the server** (``--http``): ``--new`` copies saved under as many source texts (each its own
  checksum, so the worker loads each one), ``kvfold serve`` started on them and a known copy, the known
  one asked once (checked, loaded); then the ``--new`` requests sent at once while one client asks the
  known copy again and again, one request at a time. Every request asks for 4 tokens, greedy. It
  reports the new requests' median and longest seconds, and the known file's requests' median and
  longest while the new ones ran.

It writes ``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the special magic number mentioned in the text?"


def _spread(seconds: list[float]) -> dict:
    return {"median": statistics.median(seconds), "longest": max(seconds), "count": len(seconds)}


def _while_running(work, known) -> tuple[float, list[float]]:
    """Run ``work()`` while another thread times ``known()`` again and again: (work's seconds, known's)."""
    done, waits = threading.Event(), []

    def again() -> None:
        while not done.is_set():
            start = time.perf_counter()
            known()
            waits.append(time.perf_counter() - start)
            time.sleep(0.005)

    prober = threading.Thread(target=again)
    start = time.perf_counter()
    prober.start()
    try:
        work()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        prober.join()
    return seconds, waits


def _check_all(catalog, names: list[str], workers: int) -> None:
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(catalog.check, name) for name in names]:
            future.result()


def catalog_checks(path: Path, count: int, dtype: str, out: Path, repeat: int) -> dict:
    """``count`` new copies of ``path`` checked at once beside a known one, ``repeat`` times."""
    from kvfold.integrations.vllm.requests import CacheCatalog

    folder = out / "catalog-copies"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for index in range(count + 1):
        shutil.copyfile(path, folder / f"copy{index}.kvc")
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    rounds = []
    for _ in range(repeat):
        catalog = CacheCatalog(folder, "smollm2-135m", dtype)
        catalog.check(f"copy{count}")  # the known file; the model loaded
        names = [f"copy{index}" for index in range(count)]
        seconds, waits = _while_running(
            partial(_check_all, catalog, names, workers), partial(catalog.check, f"copy{count}")
        )
        rounds.append({"seconds": seconds, "known": _spread(waits)})
    shutil.rmtree(folder, ignore_errors=True)
    middle = sorted(rounds, key=lambda r: r["seconds"])[len(rounds) // 2]
    return {"new": count, "threads": workers, "rounds": rounds, **middle}


def served_checks(path: Path, count: int, dtype: str, out: Path) -> dict:
    """``count`` requests on new files through ``kvfold serve`` while a known file is asked again and again."""
    import math

    sys.path.insert(0, str(ROOT))
    from tests.integrations.vllm.conftest import start_server  # the tests' server helpers

    import kvfold
    from kvfold.integrations.vllm.settings import BLOCK_SIZE

    folder = out / "served-copies"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    model, tokenizer = kvfold.load_model()
    context = kvfold.load_context(path, model, tokenizer)
    for index in range(count + 1):
        kvfold.save_context(context, folder / f"copy{index}.kvc", source_text=f"{path.name}, copy {index}")
    tokens = context.source.context_tokens
    length = math.ceil((tokens + 256) / BLOCK_SIZE) * BLOCK_SIZE
    server = start_server(folder, out, "--dtype", dtype, "--max-model-len", str(length), "--", "--enforce-eager",
                          "--max-num-seqs", str(count + 1))  # fmt: skip
    try:
        server.wait()

        def ask(name: str) -> float:
            start = time.perf_counter()
            status, body = server.ask(name, QUESTION, max_tokens=4)
            if status != 200:
                raise SystemExit(f"a request on {name} failed ({status}): {body}")
            return time.perf_counter() - start

        known = f"copy{count}"
        first = ask(known)
        news: list[float] = []

        def work() -> None:
            with ThreadPoolExecutor(count) as pool:
                news.extend(pool.map(ask, [f"copy{index}" for index in range(count)]))

        seconds, waits = _while_running(work, lambda: ask(known))
    finally:
        server.stop()
    shutil.rmtree(folder, ignore_errors=True)
    return {"new": count, "tokens": tokens, "known_first_seconds": first, "seconds": seconds,
            "new_requests": _spread(news), "known": _spread(waits)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a .kvc file (its copies are checked)")
    parser.add_argument("--new", type=int, default=24, help="new files at once")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the catalog's checks")
    parser.add_argument("--http", action="store_true", help="then through kvfold serve")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.cache.is_file():
        raise SystemExit(f"no cache file {args.cache}: give a .kvc file made by kvfold compress")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"settings": {"file": args.cache.name, "dtype": args.dtype, "repeat": args.repeat}}
    record["catalog"] = catalog = catalog_checks(args.cache, args.new, args.dtype, args.out, args.repeat)
    lines = [
        f"Catalog: {args.new} new copies of {args.cache.stem} checked at once ({catalog['threads']} threads, median "
        f"round of {args.repeat}): all in {catalog['seconds']:.2f} s; a known copy's {catalog['known']['count']} "
        f"checks meanwhile took {catalog['known']['median']:.3f} s (median), {catalog['known']['longest']:.3f} s at "
        "most.",
    ]
    if args.http:
        record["served"] = served = served_checks(args.cache, args.new, args.dtype, args.out)
        lines += [
            "",
            f"kvfold serve: {args.new} requests on new copies at once, 4 tokens each: "
            f"{served['new_requests']['median']:.2f} s (median), all in {served['new_requests']['longest']:.2f} s; "
            "the known copy's "
            f"{served['known']['count']} requests meanwhile took {served['known']['median']:.2f} s (median), "
            f"{served['known']['longest']:.2f} s at most ({served['known_first_seconds']:.2f} s alone, its first).",
        ]
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
