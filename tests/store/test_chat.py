"""Saved conversations (kvfold.store.chat): a chat saved and loaded continues exactly; a chat starts on
a compressed context's file."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.pipeline.chat import ChatSession
from kvfold.store.chat import load_chat, save_chat
from kvfold.store.save import save_context
from tests.conftest import CharTokenizer
from tests.pipeline.test_chat import QUESTIONS, _model


@pytest.mark.parametrize("method", ["snapkv", "h2o", "am_highest_fast"])
def test_a_saved_chat_continues_exactly(tmp_path, method):
    model = _model()
    chat = ChatSession(model, CharTokenizer(), method, 48, cap=128, max_new_tokens=5)
    for question in QUESTIONS[:4]:
        chat.ask(question)
    assert chat.compactions >= 1
    save_chat(chat, tmp_path / "talk.kvc")
    loaded = load_chat(tmp_path / "talk.kvc", model, CharTokenizer())
    assert loaded.stats()["turns"] == 4
    if chat.policy is not None:  # the policy's live per-slot state went into the file
        live = chat.cache.copy()
        chat.policy.export_state(live)
        for (_, a), (_, b) in zip(live.folded_layers, loaded.cache.folded_layers, strict=True):
            assert a.entry_stats.keys() == b.entry_stats.keys()
            assert all(torch.equal(a.entry_stats[k], b.entry_stats[k]) for k in a.entry_stats)
    expected = [chat.ask(q) for q in QUESTIONS[4:8]]
    expected_stats = chat.stats()

    assert [loaded.ask(q) for q in QUESTIONS[4:8]] == expected
    stats = loaded.stats()
    for key in ("turns", "entries", "logical_tokens", "compactions", "online", "budget", "cap", "full_bytes"):
        assert stats[key] == expected_stats[key]
    for (_, a), (_, b) in zip(chat.cache.folded_layers, loaded.cache.folded_layers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.padded(), b.padded(), strict=True))


def test_a_chat_starts_on_a_compressed_context_file(tmp_path):
    model = _model()
    text = "The vault code is 4712. " * 5
    compressed = kvfold.prefill(model, CharTokenizer(), text, use_chat_template=False).compress("snapkv", 0.25)
    save_context(compressed, tmp_path / "doc.kvc", resumable=True)
    first = compressed.generate("What is the code?", max_new_tokens=6)[0]
    chat = load_chat(tmp_path / "doc.kvc", model, CharTokenizer(), cap=100)
    assert chat.budget == compressed.budget.count(compressed.source.context_tokens)
    assert chat.ask("What is the code?", max_new_tokens=6) == first.text  # the same protocol as answer()
    for question in QUESTIONS[:6]:
        chat.ask(question, max_new_tokens=4)
    assert chat.compactions >= 2 and chat.physical_length() <= chat.cap


def test_methods_that_need_tokens_refuse_a_file_without_them(tmp_path):
    model = _model()
    compressed = kvfold.prefill(model, CharTokenizer(), "tokens " * 40, use_chat_template=False).compress(
        "am_highest_fast", 0.25
    )
    save_context(compressed, tmp_path / "doc.kvc")  # no token ids
    chat = load_chat(tmp_path / "doc.kvc", model, CharTokenizer())
    with pytest.raises(ValueError, match="re-reads the conversation's tokens.*--resumable"):
        for question in QUESTIONS:
            chat.ask(question, max_new_tokens=4)


def test_a_chat_file_of_an_unknown_state_version_is_refused(tmp_path):
    model = _model()
    chat = ChatSession(model, CharTokenizer(), "snapkv", 24, cap=64, max_new_tokens=3)
    chat.ask(QUESTIONS[0])
    state, tensors = chat.checkpoint()
    state["version"] = 99
    kvfold.save_cache(chat.cache, tmp_path / "new.kvc", model, method="snapkv", extra={"chat": state})
    with pytest.raises(ValueError, match="chat state version 99 is not supported"):
        load_chat(tmp_path / "new.kvc", model, CharTokenizer())


def test_nothing_is_saved_before_the_first_turn(tmp_path):
    chat = ChatSession(_model(), CharTokenizer(), "snapkv", 24)
    with pytest.raises(ValueError, match="ask something first"):
        save_chat(chat, tmp_path / "empty.kvc")
    assert not (tmp_path / "empty.kvc").exists()
