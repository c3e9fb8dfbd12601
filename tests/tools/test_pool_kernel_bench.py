"""benchmarks/pool_kernel.py: the served files' pool kernel timed alone, run at a small size."""

from __future__ import annotations

import json

import pytest

from kvfold.runtime import native
from kvfold.runtime.pool_attention import PoolStep
from tests.tools.scripts import load_script

pytestmark = pytest.mark.skipif(native.attend_pool_kernel() is None, reason=f"no pool kernel: {native.pool_status()}")


def test_each_format_and_step_is_one_kernel_call_timed(tmp_path, monkeypatch):
    module = load_script("benchmarks/pool_kernel.py")
    calls = []
    real = PoolStep._call
    monkeypatch.setattr(
        PoolStep, "_call", lambda self, table, count, *a: calls.append(count) or real(self, table, count, *a)
    )
    module.main(["--formats", "int4,int3", "--requests", "3", "--rows", "40", "--repeat", "2", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [(r["format"], r["tokens"]) for r in records] == [("int4", 40), ("int4", 1), ("int3", 40), ("int3", 1)]
    assert all(r["ms"] > 0 and r["gmac_per_s"] > 0 for r in records)
    assert calls == [3] * (4 * 3)  # a warm-up and 2 timed calls a record, every request in each
