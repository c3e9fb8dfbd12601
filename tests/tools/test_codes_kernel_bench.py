"""benchmarks/codes_kernel.py: the library's CPU codes kernel timed alone, run at a small size."""

from __future__ import annotations

import json
import shutil

import pytest

from kvfold.runtime import native
from tests.tools.scripts import load_script

pytestmark = pytest.mark.skipif(native.attend_codes_kernel() is None, reason=f"no codes kernel: {native.status()}")


def test_each_format_and_number_of_queries_is_a_pass_of_kernel_calls(tmp_path, monkeypatch):
    module = load_script("benchmarks/codes_kernel.py")
    calls = []
    real = module.Call.__call__
    monkeypatch.setattr(module.Call, "__call__", lambda self, kernel: calls.append(1) or real(self, kernel))
    arguments = ["--formats", "int4,int3", "--entries", "40", "--layers", "2", "--queries", "3,8", "--repeat", "2"]
    module.main([*arguments, "--out", str(tmp_path)])
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [(r["format"], r["queries"]) for r in records] == [("int4", 3), ("int4", 8), ("int3", 3), ("int3", 8)]
    assert all(r["ms"] > 0 and r["gmac_per_s"] > 0 for r in records)
    assert len(calls) == 4 * 2 * (1 + 2)  # a warm-up pass and 2 timed ones a record, a call a layer


def test_a_baseline_source_is_timed_beside_the_kernel_on_the_same_rows(tmp_path):
    """The same source (its header beside it) gives the same numbers, a changed one does not."""
    module = load_script("benchmarks/codes_kernel.py")
    source = native.SOURCE.read_text()
    halved = source.replace("s.num[i * vdim + k] += zero_sum[i];", "s.num[i * vdim + k] += 0.5f * zero_sum[i];")
    assert halved != source
    for name, text in (("same", source), ("halved", halved)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "attend_codes.c").write_text(text)
        shutil.copy(native.SOURCE.with_name("attend_blocks.h"), folder / "attend_blocks.h")
        arguments = ["--formats", "int4", "--entries", "40", "--layers", "2", "--queries", "3", "--repeat", "3"]
        module.main([*arguments, "--baseline", str(folder / "attend_codes.c"), "--out", str(folder)])
        (record,) = json.loads((folder / "results.json").read_text())["records"]
        assert record["baseline_ms"] > 0 and 0 < record["ratio_p10"] <= record["ratio"] <= record["ratio_p90"]
        assert (record["max_relative_difference"] == 0.0) == (name == "same")


def test_a_baseline_that_is_not_there_or_does_not_build_is_one_line(tmp_path):
    module = load_script("benchmarks/codes_kernel.py")
    with pytest.raises(SystemExit, match="no such file"):
        module.main(["--formats", "int4", "--entries", "8", "--baseline", str(tmp_path / "old.c")])
    broken = tmp_path / "broken.c"
    broken.write_text("int kvfold_attend_codes( {\n")
    with pytest.raises(SystemExit, match="building the kernel failed") as stopped:
        module.main(["--formats", "int4", "--entries", "8", "--baseline", str(broken)])
    assert "\n" not in str(stopped.value)
