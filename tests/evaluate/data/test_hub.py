"""Reading published benchmarks: LongBench's middle truncation, and a clear error without ``datasets``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvfold.evaluate.data.hub import truncate_middle
from kvfold.evaluate.data.xsum import load_xsum
from tests.evaluate.data.conftest import write_jsonl


def test_truncate_middle_by_hand() -> None:
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError, match="positive"):
        truncate_middle([1], 0)


def test_missing_datasets_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = write_jsonl(tmp_path / "x.jsonl", [{"document": "d", "summary": "s", "id": "1"}])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'kvfold\[datasets\]'"):
        load_xsum(file)
