"""``benchmarks/serve_load.py``, as its docs run it: what a file costs the first time a request names it."""

from __future__ import annotations

import json
import shutil

from tests.tools.scripts import run_script


def _run(*args: str):
    return run_script("benchmarks/serve_load.py", *args)


def test_every_file_is_checked_read_packed_and_copied(saved, tmp_path):
    folder = tmp_path / "caches"
    folder.mkdir()
    for name in ("mem16", "kvzip"):
        shutil.copyfile(saved[name], folder / f"{name}.kvc")
    done = _run("--caches", str(folder), "--repeat", "1", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["files"]
    assert [row["file"] for row in rows] == ["kvzip", "mem16"]
    for row in rows:
        assert row["chunks"] > 0 and row["context_tokens"] > 0
        steps = [row[f"{step}_seconds"] for step in ("read", "pack", "copy")]
        assert all(s > 0 for s in [*steps, row["check_seconds"]])
        assert row["worker_seconds"] == sum(steps)
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| mem16 |" in table and "| kvzip |" in table


def test_a_folder_without_files_is_one_line(tmp_path):
    done = _run("--caches", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == f"no .kvc files in {tmp_path}"
