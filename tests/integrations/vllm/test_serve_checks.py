"""``benchmarks/serve_checks.py``, as its docs run it (the catalog's part; ``--http`` starts a server of
its own and is left to the benchmark runs)."""

from __future__ import annotations

import json

from tests.tools.scripts import run_script


def _run(*args: str):
    return run_script("benchmarks/serve_checks.py", *args)


def test_new_copies_are_checked_at_once_beside_a_known_one(saved, tmp_path):
    done = _run("--cache", str(saved["mem16"]), "--new", "3", "--repeat", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    catalog = json.loads((tmp_path / "results.json").read_text())["catalog"]
    assert catalog["new"] == 3 and len(catalog["rounds"]) == 2 and catalog["seconds"] > 0
    assert catalog["known"]["count"] >= 1 and catalog["known"]["longest"] >= catalog["known"]["median"] >= 0
    assert "new copies of mem16 checked at once" in (tmp_path / "results.md").read_text()
    assert not (tmp_path / "catalog-copies").exists()  # the copies are removed


def test_a_missing_file_is_one_line(tmp_path):
    done = _run("--cache", str(tmp_path / "none.kvc"), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("no cache file")
