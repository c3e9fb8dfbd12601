"""The README's worked example (section "Architecture", "Adding a method") runs as written.

The section holds two Python blocks: a method module and its test. The method is registered
for the duration of these tests only, then removed from the registry.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfold.methods import REGISTRY

README = Path(__file__).resolve().parents[2] / "README.md"


def _example_blocks() -> tuple[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the Architecture section holds the example method and its test"
    return blocks[0], blocks[1]


METHOD_CODE, TEST_CODE = _example_blocks()


def _module(name: str, code: str, origin: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look the module up
    exec(compile(code, origin, "exec"), module.__dict__)
    return module


TEST_NAMES = sorted(n for n in re.findall(r"^def (test_\w+)\(", TEST_CODE, flags=re.M))


@pytest.fixture
def example_tests() -> Iterator[types.ModuleType]:
    method = _module("kvfold_readme_value_norm", METHOD_CODE, "README.md: value_norm.py")
    tests = _module("kvfold_readme_test_value_norm", TEST_CODE, "README.md: test_value_norm.py")
    try:
        yield tests
    finally:
        for cls in list(vars(method).values()):
            if isinstance(cls, type) and REGISTRY.get(getattr(cls, "name", None)) is cls:
                del REGISTRY[cls.name]
        sys.modules.pop(method.__name__, None)
        sys.modules.pop(tests.__name__, None)


def test_the_example_is_a_short_method_with_its_test():
    assert len(TEST_NAMES) >= 1
    assert 30 <= len(METHOD_CODE.splitlines()) + len(TEST_CODE.splitlines()) <= 90
    assert "@register" in METHOD_CODE


@pytest.mark.parametrize("name", TEST_NAMES)
def test_readme_example(example_tests: types.ModuleType, name: str) -> None:
    getattr(example_tests, name)()
