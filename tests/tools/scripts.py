"""The repository's scripts (``benchmarks/``, ``tools/``) loaded as modules, for their tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """``ROOT / relative`` (``"benchmarks/key_scores.py"``) executed as a fresh module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(relative: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python ROOT/relative args`` in this Python, one torch thread, its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / relative), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
