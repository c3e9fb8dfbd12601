"""``kvfold demo``: by default the full cache, ``kvzip``, ``leverage`` and the recommended pipeline;
``--methods all`` every method that runs alone. Run end to end on a tiny random model (the timing
on SmolLM2 is measured in the README, not here)."""

from __future__ import annotations

import pytest

import kvfold
import kvfold.cli.demo
import kvfold.runtime.models
from kvfold.cli.demo import DEFAULT_METHODS, demo_specs
from kvfold.cli.main import main
from kvfold.evaluate.data.logbook import FACTS
from kvfold.methods import RECOMMENDED, available_methods, build_method
from tests.conftest import CharTokenizer, make_tiny_model


def test_default_demo_methods_are_kvzip_leverage_and_the_recommended_pipeline():
    assert demo_specs() == ["kvzip", "leverage", RECOMMENDED] == list(DEFAULT_METHODS)
    build_method(RECOMMENDED)  # a valid spec
    everything = demo_specs("all")
    assert set(everything) == {c.name for c in available_methods() if c.role not in ("wrapper", "folder")}
    assert {"leverage", "compactor", "kvzip", "snapkv"} <= set(everything)
    assert demo_specs("snapkv, global:leverage+am_fit") == ["snapkv", "global:leverage+am_fit"]


@pytest.fixture
def tiny_demo_model(monkeypatch):
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=1024))
    # where the demo looks it up when it runs (patching ``kvfold.load_model`` left the demo on SmolLM2)
    load = lambda spec, dtype="auto", device="auto": (model, CharTokenizer())  # noqa: E731
    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    # a short context (the built-in one is ~3K characters, i.e. tokens of the char tokenizer)
    short = " ".join(f"The tide rose on day {i}. {fact}" for i, (fact, _, _) in enumerate(FACTS))
    monkeypatch.setattr(kvfold.cli.demo, "build_logbook", lambda tokenizer, target_tokens=3000: short)
    return model


def table_rows(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    return [line.split()[0] for line in lines[start:] if line.strip()]


def test_demo_cli_shows_the_default_methods_side_by_side(capsys, tiny_demo_model):
    assert main(["demo"]) == 0
    out, err = capsys.readouterr()
    assert table_rows(out) == ["full", "kvzip", "leverage", RECOMMENDED]
    assert "/5" in out  # answers counted over the 5 questions
    assert err.startswith("Loading ") and "Loading" not in out  # progress on stderr, the table on stdout
    assert main(["demo", "--methods", "full", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_demo_cli_methods_all_runs_every_method(capsys, tiny_demo_model):
    assert main(["demo", "--methods", "all"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows == ["full", *[s for s in demo_specs("all") if s != "full"]]


def test_the_demo_runs_on_the_embedded_model(capsys, smollm2):
    """``make demo``'s path, shortened: the embedded SmolLM2 (skipped where its package is not installed), its
    own tokenizer and context; the compressed cache holds about a tenth of the full one's bytes."""
    assert main(["demo", "--length", "1000", "--methods", "kvzip", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert table_rows(out) == ["full", "kvzip"]
    lines = out.splitlines()
    full, kvzip = (next(line.split() for line in lines if line.startswith(name + " ")) for name in ("full", "kvzip"))
    assert full[1].endswith("/5") and kvzip[1].endswith("/5")
    assert float(full[4]) == 1.0 and 0.08 < float(kvzip[4]) < 0.13  # of the 16-bit full cache's bytes
