"""Fixtures of the store tests: a tiny Llama saved as a model folder, and an int4 cache file it made."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_tiny_model
from tests.runtime.test_models import _write_tokenizer

CONTEXT = " ".join(f"w{(i * 7) % 96 + 1}" for i in range(160))
"""A context of the word-level tokenizer's words (160 tokens)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, 2 KV heads, head_dim 16) and its word-level tokenizer, saved."""
    path = tmp_path_factory.mktemp("tiny-llama-store")
    make_tiny_model("llama").save_pretrained(path)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def int4_file(tiny_model_dir, tmp_path_factory) -> Path:
    """``snapkv@int4`` at a quarter of :data:`CONTEXT`, saved by the model of :func:`tiny_model_dir`."""
    import kvfold

    model, tokenizer = kvfold.load_model(str(tiny_model_dir))
    context = kvfold.prefill(model, tokenizer, CONTEXT, use_chat_template=False, methods="snapkv")
    path = tmp_path_factory.mktemp("int4") / "doc.kvc"
    kvfold.save_context(context.compress("snapkv@int4", 0.25), path, source_text=CONTEXT)
    return path
