"""Every entry point that compresses defaults to the recommended pipeline (:mod:`kvfold.runtime.defaults`):
``kvfold generate``, ``kvfold compress``, ``kvfold chat``, ``kvfold bench``,
:meth:`kvfold.PrefilledContext.compress` at a tenth of the context, and
:class:`kvfold.pipeline.chat.ChatSession` at its own cap in entries."""

from __future__ import annotations

import json

import pytest

import kvfold
from kvfold.cli.main import _load_extra_commands, build_parser, main
from kvfold.methods import RECOMMENDED
from kvfold.pipeline.chat import ChatSession
from kvfold.runtime import defaults
from tests.conftest import CharTokenizer, make_tiny_model
from tests.evaluate.bench.conftest import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _parse(*argv: str):
    _load_extra_commands()
    return build_parser().parse_args(list(argv))


def test_the_recommended_pipeline_is_written_once():
    assert RECOMMENDED == defaults.RECOMMENDED == "kvzip+am_fit" and defaults.DEFAULT_BUDGET == 0.1
    kvfold.build_method(RECOMMENDED)  # a spec that builds


def test_compress_keeps_a_tenth_with_the_recommended_pipeline_by_default():
    model = kvfold.prepare_model(make_tiny_model())
    context = kvfold.prefill(model, CharTokenizer(), "the quick brown fox jumps over the lazy dog " * 3)
    small = context.compress()
    assert small.method.spec == RECOMMENDED and small.budget.label() == 0.1
    assert small.kv_bytes < 0.2 * small.kv_bytes_full
    assert context.compress("full").kv_bytes == context.cache.nbytes()  # full is one word away


def test_a_chat_compacts_with_the_recommended_pipeline_at_its_own_cap():
    session = ChatSession(kvfold.prepare_model(make_tiny_model()), CharTokenizer())
    assert session.method.spec == RECOMMENDED
    assert session.budget == defaults.DEFAULT_CHAT_BUDGET and session.cap == 2 * defaults.DEFAULT_CHAT_BUDGET


def test_the_commands_default_to_the_recommended_pipeline():
    generate = _parse("generate", "--context", "c", "--question", "q")
    assert (generate.method, generate.budget) == (None, None)  # resolved in run_generate: a --cache refuses them
    compress = _parse("compress", "--context", "c", "--out", "x.kvc")
    assert (compress.method, compress.budget) == (RECOMMENDED, None)  # a tenth unless --memory (run_compress)
    chat = _parse("chat")
    assert (chat.method, chat.budget) == (None, None)
    bench = _parse("bench", "--out", "runs/b")  # the recommended pipeline against full, at one length
    assert (bench.methods, bench.budgets, bench.length, bench.batch) == (RECOMMENDED, "0.1", "2048", "1")


def test_generate_compresses_with_the_recommended_pipeline_and_says_so(tiny_dir, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--context", "w1 w2 w3 w4 " * 40, "--question", "w3?"]
    assert main([*argv, "--new-tokens", "2", "--json", "--quiet"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["method"] == RECOMMENDED and record["budget"] == 0.1
    assert record["kv_bytes"] < 0.2 * record["kv_bytes_full"]
    assert main([*argv, "--new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"compressing {record['context_tokens']} tokens with {RECOMMENDED} (the recommended pipeline)" in err
    assert f"[{RECOMMENDED} (the recommended pipeline) @ 0.1]" in err
    assert main([*argv, "--new-tokens", "2", "--quiet"]) == 0
    assert "compressing" not in capsys.readouterr().err  # --quiet: the summary only


def test_models_and_kernels_are_kept_under_one_cache_folder(monkeypatch, tmp_path):
    """``$KVFOLD_CACHE`` moves both the converted models and the compiled kernels; without it
    ``$XDG_CACHE_HOME/kvfold``, then ``~/.cache/kvfold``."""
    from kvfold.runtime import gguf_conversion, native

    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "mine"))
    assert defaults.cache_root() == tmp_path / "mine"
    assert native.cache_dir() == tmp_path / "mine" / "kernels"
    assert gguf_conversion.converted_root() == tmp_path / "mine" / "converted"
    monkeypatch.delenv("KVFOLD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "kvfold" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert defaults.cache_root() == tmp_path / "home" / ".cache" / "kvfold"
