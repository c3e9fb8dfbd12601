"""benchmarks/fit_products.py: one layer's Attention Matching fits by both products in one process (the GPU
run's ``fits`` phase), run at small sizes on the CPU."""

from __future__ import annotations

import json

from kvfold.methods.compaction.attention_matching import solve
from kvfold.runtime import exact_products
from tests.tools.scripts import load_script


def test_the_bench_fits_by_each_product_in_turn_and_records_how_far_apart(tmp_path, monkeypatch):
    module = load_script("benchmarks/fit_products.py")
    forced, shapes = [], []
    real = solve.fit_problems

    def counted(keys, *args, **kwargs):
        forced.append(exact_products.FORCED)
        shapes.append((tuple(keys.shape), keys.dtype, tuple(kwargs["given"].shape)))
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(solve, "fit_problems", counted)
    out = tmp_path / "fits.jsonl"
    args = ["--device", "cpu", "--problems", "2,3", "--entries", "40", "--queries", "90", "--kept", "7"]
    module.main([*args, "--head-dim", "16", "--reps", "2", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["problems"] for r in records] == [2, 3]
    for record in records:
        assert set(record["ms"]) == set(record["logit_tflops"]) == {"float32 products", "16-bit operands"}
        assert record["fit_products"] == "float32 products (on cpu)"  # the CPU converts both
        assert record["largest_value_difference"] == 0.0
        assert record["output_error"]["float32 products"] == record["output_error"]["16-bit operands"] > 0
    # the float32 path forced, the 16-bit one as the device decides: a warm-up and 2 timed fits each, a size
    assert forced == [False, None] * 3 * 2
    assert shapes[0] == ((2, 40, 16), exact_products.OPERAND_DTYPES[1], (2, 7)) and shapes[-1][0] == (3, 40, 16)
    assert exact_products.FORCED is None  # left as found
