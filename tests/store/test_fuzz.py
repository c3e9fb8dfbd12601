"""Fuzzing the cache-file format: every mutated file loads and answers, or is refused in one line; every
file that loads and the server would serve is also packed into an engine's blocks and attended by the
pool kernel (its debug build), which must neither refuse nor give a non-finite output.

Seeded and bounded (``KVFOLD_FUZZ_CASES`` cases, 250 by default; ``KVFOLD_FUZZ_SEED``, 0): the cases
run in a child process (:mod:`tests.store.fuzz_cases`) with the debug kernel (``KVFOLD_NATIVE_DEBUG=1``:
every index it reads is checked), so that a crash is its exit signal, a hang its timeout and an
unbounded allocation an error under its address-space limit, each named with the case it hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = int(os.environ.get("KVFOLD_FUZZ_CASES", "250"))
SEED = int(os.environ.get("KVFOLD_FUZZ_SEED", "0"))
TIMEOUT = 120 + CASES // 2
"""Seconds the child may take (it takes about 30 s for 250 cases on two shared cores)."""


def test_every_mutated_file_loads_and_answers_or_is_refused_in_one_line(tmp_path):
    out = tmp_path / "cases.jsonl"
    env = {**os.environ, "KVFOLD_NATIVE_DEBUG": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        child = subprocess.run(
            [sys.executable, "-m", "tests.store.fuzz_cases", str(out), str(SEED), str(CASES)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        failure = None if child.returncode == 0 else f"exit status {child.returncode}: {child.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        failure = f"no end within {TIMEOUT} s (a hang)"
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    ends = [r for r in records if "outcome" in r]
    if failure is not None:
        last = records[-1] if records else "before the first case"
        raise AssertionError(f"the fuzzer failed at {last}: {failure}")
    assert len(ends) == CASES + 6, f"{len(ends)} outcomes for {CASES} cases and 6 good files"
    assert all(r["outcome"] == "loaded" for r in ends if str(r["case"]).startswith("good")), ends[:5]
    errors = [r for r in ends if r["outcome"] == "error"]
    assert not errors, "\n".join(f"{r['case']} {r.get('base')} {r.get('mutation')}: {r['detail']}" for r in errors)
    counts = Counter(r["outcome"] for r in ends[6:])
    assert counts["refused"] > CASES // 2 and counts["loaded"] > 0, counts
    pooled = sum(r["detail"].endswith("; pooled") for r in ends[6:] if r["outcome"] == "loaded")
    assert pooled > 0, "no mutated file that loads was attended by the pool kernel"
    print(
        f"\n{CASES} mutated files (seed {SEED}): {counts['loaded']} loaded and answered ({pooled} of them also "
        f"attended in an engine's blocks by the pool kernel), {counts['refused']} refused"
    )
