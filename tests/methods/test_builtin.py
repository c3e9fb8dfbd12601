"""Registration is explicit: importing :mod:`kvfold.methods` registers every built-in method."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvfold.methods
from kvfold.methods import REGISTRY, available_methods

METHODS = Path(kvfold.methods.__file__).resolve().parent


def _registering_modules() -> list[str]:
    """Every module under :mod:`kvfold.methods` that defines a method with ``@register``."""
    found = []
    for path in sorted(METHODS.rglob("*.py")):
        if "\n@register\n" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(METHODS.parents[1]).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_every_module_that_registers_a_method_is_imported_by_builtin():
    modules = _registering_modules()
    assert "kvfold.methods.eviction.snapkv" in modules
    probe = "import sys, kvfold.methods; print('\\n'.join(sorted(sys.modules)))"  # a fresh interpreter
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(run.stdout.split())
    assert [name for name in modules if name not in loaded] == []


def test_the_registry_holds_the_methods_without_a_lookup_first():
    assert {"full", "snapkv", "adakv", "criticalkv", "keepkv", "zsmerge", "grkv", "am_fit"} <= set(REGISTRY)
    assert [c.name for c in available_methods()] == sorted(REGISTRY)
