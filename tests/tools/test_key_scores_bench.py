"""benchmarks/key_scores.py: KVzip's scores by both paths in one process (the GPU run's ``scores`` phase),
run at small sizes with the kernel under Triton's interpreter."""

from __future__ import annotations

import json

import pytest

from kvfold.runtime import key_scores, triton_attention
from tests.tools.scripts import load_script

pytestmark = pytest.mark.skipif(
    not triton_attention.available() or not triton_attention.interpreted(),
    reason="no Triton, or Triton's interpreter not chosen before Triton was imported (tests/conftest.py)",
)


def test_the_bench_times_each_path_and_records_their_difference(tmp_path, monkeypatch):
    module = load_script("benchmarks/key_scores.py")
    calls = {"fused_max_logits": 0, "blocked_max_logits": 0}

    def counted(name):
        real = getattr(key_scores, name)
        return lambda *a: calls.__setitem__(name, calls[name] + 1) or real(*a)

    for name in calls:
        monkeypatch.setattr(key_scores, name, counted(name))
    out = tmp_path / "scores.jsonl"
    args = ["--device", "cpu", "--entries", "130,40", "--tokens", "20", "--kv-heads", "2", "--group", "2"]
    module.main([*args, "--head-dim", "32", "--reps", "2", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["entries"] for r in records] == [130, 40]
    for record in records:
        assert set(record["ms"]) == {"float32 products", "triton kernel"}
        assert record["largest_relative_difference"] < 1e-5 and record["rows"] == 40
    # each path forced in turn: a warm-up and 2 timed calls a length
    assert calls == {"fused_max_logits": 6, "blocked_max_logits": 6}
    assert key_scores.FUSED_FORCED is None  # left as found


def test_the_bench_times_each_block_size_it_is_given(tmp_path, monkeypatch):
    module = load_script("benchmarks/key_scores.py")
    sizes = []
    real = key_scores.fused_max_logits
    monkeypatch.setattr(
        key_scores,
        "fused_max_logits",
        lambda *a: sizes.append((key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS)) or real(*a),
    )
    own = (key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS)
    out = tmp_path / "scores.jsonl"
    args = ["--device", "cpu", "--entries", "70", "--tokens", "20", "--kv-heads", "2", "--group", "2"]
    module.main([*args, "--head-dim", "16", "--reps", "1", "--blocks", "64x32,16x16", "--out", str(out)])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(record["ms"]) == {"float32 products", "triton kernel 64x32", "triton kernel 16x16"}
    assert set(record["products_over_kernel"]) == {"triton kernel 64x32", "triton kernel 16x16"}
    assert sizes == [(64, 32), (16, 16)] * 2 and record["largest_relative_difference"] < 1e-5
    assert own == (key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS)  # kvfold's own again
