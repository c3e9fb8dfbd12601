"""benchmarks/pool_kernel.py: the served files' pool kernel timed alone, run at a small size."""

from __future__ import annotations

import json
import shutil

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


def test_a_baseline_source_is_timed_beside_the_kernel_on_the_same_rows(tmp_path):
    module = load_script("benchmarks/pool_kernel.py")
    source = native.POOL_SOURCE.read_text()
    halved = source.replace("const float inverse = 1.0f / own.den[i]", "const float inverse = 0.5f / own.den[i]")
    assert halved != source
    shutil.copy(native.POOL_SOURCE.with_name("attend_blocks.h"), tmp_path / "attend_blocks.h")  # it includes
    for name, text in (("same.c", source), ("halved.c", halved)):
        (tmp_path / name).write_text(text)
        out = tmp_path / name.removesuffix(".c")
        arguments = ["--formats", "int4", "--requests", "2", "--rows", "40", "--repeat", "3", "--layers", "2"]
        module.main([*arguments, "--baseline", str(tmp_path / name), "--out", str(out)])
        records = json.loads((out / "results.json").read_text())["records"]
        assert [r["tokens"] for r in records] == [40, 1]
        for r in records:
            assert r["baseline_ms"] > 0 and 0 < r["ratio_p10"] <= r["ratio"] <= r["ratio_p90"]
            # the baseline's outputs are its own: the same source gives the same numbers, a changed one does not
            assert (r["max_difference"] == 0.0) == (name == "same.c")


def test_a_baseline_that_is_not_there_is_one_line(tmp_path):
    module = load_script("benchmarks/pool_kernel.py")
    with pytest.raises(SystemExit, match="no such file"):
        module.main(["--formats", "int4", "--requests", "1", "--rows", "8", "--baseline", str(tmp_path / "old.c")])


def test_a_baseline_that_does_not_build_says_why_and_leaves_the_kernels_status(tmp_path):
    module = load_script("benchmarks/pool_kernel.py")
    broken = tmp_path / "broken.c"
    broken.write_text("int kvfold_attend_pool( {\n")
    with pytest.raises(SystemExit, match="building the pool kernel failed") as stopped:
        module.main(["--formats", "int4", "--requests", "1", "--rows", "8", "--baseline", str(broken)])
    assert "\n" not in str(stopped.value)
    assert native.pool_status().startswith("native")  # the project's kernel is still the one served


def test_every_layer_is_attended_in_each_timed_pass(monkeypatch):
    module = load_script("benchmarks/pool_kernel.py")
    layers = []
    real = PoolStep.attend
    monkeypatch.setattr(PoolStep, "attend", lambda self, layer, *a: layers.append(layer) or real(self, layer, *a))
    times, difference = module.step_times("int4", 2, 24, module.torch.float32, 1, repeat=2, layers=3)
    assert layers == [0, 1, 2] * 3  # a warm pass, then two timed ones
    assert len(times) == 1 and len(times[0]) == 2 and difference == 0.0


def test_two_kernels_take_turns_going_first(monkeypatch):
    module = load_script("benchmarks/pool_kernel.py")
    steps = []
    real = PoolStep.attend
    monkeypatch.setattr(PoolStep, "attend", lambda self, layer, *a: steps.append(self) or real(self, layer, *a))
    kernel = native.attend_pool_kernel()
    times, _ = module.step_times("int4", 2, 24, module.torch.float32, 1, repeat=3, layers=1, kernels=(None, kernel))
    first, second = steps[0], steps[1]
    assert first is not second
    # a warm pass of each, then repeats 0 and 2 with the project's kernel first, repeat 1 with the baseline first
    assert steps == [first, second, first, second, second, first, first, second]
    assert [len(t) for t in times] == [3, 3]


def test_requests_on_fewer_files_share_their_files_blocks_as_an_engine_has_them():
    """--files 2: six requests on two files in turn, each file's blocks held once and named by its
    requests' block tables, its tables one object (as an engine's prefix cache and the backend give
    them), so that the kernel reads each file once for its requests' queries."""
    import torch

    module = load_script("benchmarks/pool_kernel.py")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel's threads: one, so that each file's requests make one tile
    try:
        engine, step, query = module._scene("int4", 6, 40, 2, torch.float32, 1, files=2)
    finally:
        torch.set_num_threads(threads)
    held = [r.file.placeholders // module.BLOCK for r in step]
    assert [r.file for r in step[::2]] == [step[0].file] * 3 and step[1].file is not step[0].file
    for index, (request, n) in enumerate(zip(step, held, strict=True)):
        assert torch.equal(request.blocks[:n], step[index % 2].blocks[:n])
    own = [r.blocks[n] for r, n in zip(step, held, strict=True)]
    assert len(set(map(int, own))) == 6  # each request's own tokens in blocks of its own
    tiles = PoolStep(engine, step).tiles()
    assert sorted(map(sorted, tiles)) == [[0, 2, 4], [1, 3, 5]]
    alone = module._scene("int4", 6, 40, 2, torch.float32, 1)[1]
    assert len({id(r.file) for r in alone}) == 6  # by default, a file a request


def test_more_files_than_requests_is_one_line():
    module = load_script("benchmarks/pool_kernel.py")
    with pytest.raises(SystemExit, match="--files takes 1 to --requests"):
        module.main(["--requests", "2", "--files", "3"])


def test_another_models_layout_gives_each_kv_head_its_group_of_queries(tmp_path, monkeypatch):
    module = load_script("benchmarks/pool_kernel.py")
    shapes = []
    real = PoolStep.attend
    monkeypatch.setattr(
        PoolStep, "attend", lambda self, layer, q, *a: shapes.append(tuple(q.shape)) or real(self, layer, q, *a)
    )
    arguments = ["--formats", "int4", "--requests", "2", "--rows", "40", "--repeat", "1", "--out", str(tmp_path)]
    module.main([*arguments, "--group", "4", "--head-dim", "128"])
    assert set(shapes) == {(2 * 40, 12, 128), (2, 12, 128)}  # 3 KV heads × 4 query heads, of 128 channels
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert records[1]["gmac_per_s"] == pytest.approx(2 * 12 * 40 * 2 * 128 / (records[1]["ms"] / 1e3) / 1e9)
    with pytest.raises(SystemExit, match="--group takes a positive number"):
        module.main([*arguments, "--group", "0"])
