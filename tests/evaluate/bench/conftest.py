"""A tiny local model directory (weights and tokenizer) that the measuring processes load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_tiny_model
from tests.runtime.test_models import _write_tokenizer


def write_tiny_model(path: Path) -> Path:
    """A tiny random Llama and its tokenizer, saved as a model directory at ``path``."""
    make_tiny_model("llama").save_pretrained(path)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
