"""tools/triton_targets.py: kvfold's Triton kernels compiled for an H200 (sm_90) on a machine without a GPU
(Triton's own ptxas): every variant compiles, fits in shared memory and spills no register."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.backends.nvidia import compiler

        compiler.get_ptxas(90)
    except Exception:  # noqa: BLE001 - no NVIDIA backend or no ptxas: nothing to compile with
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not installed")


def _run(*args: str) -> tuple[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "triton_targets.py"), "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    return done.returncode, json.loads(done.stdout)


def test_every_kernel_variant_compiles_for_an_h200_without_spilling():
    code, records = _run()
    assert len(records) == 10
    for record in records:
        assert "error" not in record, record
        assert record["fits"] and record["spill_stores"] == 0 and record["spill_loads"] == 0, record
        assert 0 < record["registers"] <= 255 and record["warps"] == 8, record
    assert code == 0
    scores = [r for r in records if r["variant"].startswith("max_logit")]
    assert [r["variant"] for r in scores] == ["max_logit bf16", "max_logit fp16"]
    assert all(r["tensor_cores"] == "wgmma" for r in scores)  # KVzip's scores on tensor cores: the kernel's point
    decode = [r for r in records if r["variant"].startswith("stored_part")]
    assert all(r["tensor_cores"] is None for r in decode)  # a decode's products in float32 ("ieee"): bound by bytes


def test_the_tool_sees_spills():
    """Triton's default launch (3 stages, 4 warps) spills in the page loop: the tool reports it and fails,
    so the test above would fail if kvfold's launch options spilled."""
    code, records = _run("--default-launch", "--only", "bits=16 page=32")
    assert [r["variant"] for r in records] == ["stored_part bits=16 page=32"]
    assert records[0]["spill_stores"] > 0 and code == 1
