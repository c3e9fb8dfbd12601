"""What ``kvfold bench`` records (:mod:`kvfold.evaluate.bench.records`); the runner's records end to end:
test_speed.py."""

from __future__ import annotations

from kvfold.evaluate.bench.records import compression_ratios


def test_compression_ratios_of_an_older_record_without_repeat_time():
    assert compression_ratios({"compress_s": 3.0, "prefill_s": 2.0}) == {
        "compress_over_prefill": 1.5,
        "compress_over_repeat": None,
    }
