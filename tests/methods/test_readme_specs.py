"""Every method spec the README names still parses, builds and compresses (names and options unchanged)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvfold
from kvfold.methods import REGISTRY, SpecError, build_method, parse_spec, split_specs
from kvfold.methods.core.base import _load_builtin_methods
from tests.conftest import CharTokenizer, make_tiny_model

README = Path(__file__).resolve().parents[2] / "README.md"


def _candidates(text: str) -> set[str]:
    """Inline code spans, ``--method(s) X`` arguments and string literals given to ``compress``."""
    found = set(re.findall(r"`([^`\n]+)`", text))
    found |= set(re.findall(r"--methods? ([^\s`]+)", text))
    found |= set(re.findall(r"compress\(\"([^\"]+)\"", text))
    return found


def _is_spec(text: str) -> bool:
    """A full spec: it parses and every component is a registered method (``+cam`` or ``adakv:`` alone are not)."""
    try:
        parsed = parse_spec(text)
    except SpecError:
        return False
    names = [w.name for w in parsed.wrappers] + [parsed.selector.name]
    names += [parsed.folder.name] if parsed.folder is not None else []
    return all(name in REGISTRY for name in names)


def readme_specs() -> list[str]:
    _load_builtin_methods()
    specs = set()
    for candidate in _candidates(README.read_text(encoding="utf-8")):
        try:
            pieces = split_specs(candidate)
        except SpecError:
            continue
        specs.update(p for p in pieces if _is_spec(p))
    return sorted(specs)


SPECS = readme_specs()


def test_the_readme_names_the_methods():
    assert len(SPECS) >= 20, SPECS
    for name in ("snapkv", "adakv:snapkv", "snapkv+grkv", "zsmerge", "keepkv", "am_highest_fast", "kvzip", "leverage"):
        assert name in SPECS
    for name in ("compactor", "global:snapkv", "global[minimum=0]:kvzip[layerwise=true]"):
        assert name in SPECS


@pytest.fixture(scope="module")
def prefilled() -> kvfold.PrefilledContext:
    """One tiny model and context, prefilled once for every spec (their query windows included)."""
    model = kvfold.enable(make_tiny_model("llama"))
    text = "the readme methods still run, " * 3
    return kvfold.prefill(model, CharTokenizer(), text, use_chat_template=False, methods=SPECS)


@pytest.mark.parametrize("spec", SPECS)
def test_every_readme_spec_builds_and_compresses_a_tiny_model(prefilled, spec):
    small = prefilled.compress(build_method(spec), 0.5)
    assert small.kv_bytes <= small.kv_bytes_full, spec
    answer = small.generate("?", max_new_tokens=2, use_chat_template=False)[0]
    assert 1 <= answer.new_tokens <= 2, spec
