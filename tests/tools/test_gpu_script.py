"""benchmarks/gpu.sh: its phases fit the device's time (``BUDGET``), run on the CPU at the tiny shape."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.tools.scripts import ROOT


def _gpu_sh(out, **settings: str) -> str:
    """Run the script with ``settings`` in its environment; its log."""
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "TINY": "1", "OUT": str(out), **settings}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return (out / "log.txt").read_text()


def test_a_phase_is_cut_to_what_the_budget_leaves(tmp_path):
    """The CUDA tests' 2,000 s are cut to what a 1,000 s budget leaves, less the report's 20."""
    log = _gpu_sh(tmp_path, PHASES="tests", BUDGET="1000", T_TESTS="2000")
    cut = next(line for line in log.splitlines() if "tests: 2000s cut to the " in line)
    left = int(cut.split("cut to the ")[1].split("s")[0])
    elapsed = int(cut.split("[gpu.sh ")[1].split("s]")[0])
    # the log's elapsed is read from the clock after `left` was: a second may have turned in between
    assert 1000 - 20 - elapsed - 2 <= left <= 1000 - 20 - elapsed + 1
    assert (tmp_path / "test_cuda.txt").exists()  # the phase ran


def test_phases_past_the_budget_are_skipped_in_the_order_named_and_the_report_is_written(tmp_path):
    """Phases run in the order ``PHASES`` names them, not the script's (``memory`` comes after ``tests``
    there): a second call spends what is left on the phase it names first."""
    log = _gpu_sh(tmp_path, PHASES="memory tests report", BUDGET="1")
    skipped = [line.split("] ")[1] for line in log.splitlines() if "skipped" in line]
    assert skipped == ["memory kvzip+am_fit: skipped, BUDGET=1s is spent", "tests: skipped, BUDGET=1s is spent"]
    assert not (tmp_path / "test_cuda.txt").exists() and not (tmp_path / "bench-memory").exists()
    assert (tmp_path / "README.md").exists()


def test_a_phase_it_does_not_have_is_one_line_before_anything_runs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "PHASES": "tests sweet report"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "gpu.sh: no phase 'sweet' in PHASES; the phases are: "
        "env tests compiled batch long short memory profile suite groups scores fits report\n"
    )
    assert not (tmp_path / "out").exists()


def _wheel_of(distribution: str, folder) -> None:
    """A wheel of an installed pure-Python distribution: its files (caches apart) in one zip, as pip built it."""
    import importlib.metadata
    import zipfile

    dist = importlib.metadata.distribution(distribution)
    name = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / name, "w") as wheel:
        for file in dist.files:
            if "__pycache__" not in file.parts and not file.parts[0].startswith(".."):
                wheel.write(dist.locate_file(file), str(file))


def test_the_suite_runs_in_processes_from_carried_wheels_where_its_python_lacks_pytest_xdist(tmp_path):
    """The GPU machine has no pytest-xdist and no network: the suite phase unpacks the wheels in ``WHEELS``
    onto the path and runs the tests in ``SUITE_WORKERS`` processes."""
    hidden = tmp_path / "hidden" / "xdist"  # this Python's own pytest-xdist, out of reach
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed here')\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for distribution in ("pytest-xdist", "execnet"):
        _wheel_of(distribution, wheels)
    out = tmp_path / "out"
    log = _gpu_sh(
        out,
        PHASES="suite",
        BUDGET="0",
        PYTHONPATH=str(hidden.parent),
        WHEELS=str(wheels),
        SUITE_WORKERS="2",
        SUITE_TESTS="tests/tools/test_current_results.py",
    )
    assert f"suite: pytest-xdist from the wheels in {wheels}" in log
    suite = (out / "suite.txt").read_text()
    assert "bringing up nodes" in suite and " passed" in suite.splitlines()[-1], suite
