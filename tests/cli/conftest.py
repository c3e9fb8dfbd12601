"""The evaluation fixtures (tokenizers, a tiny model) for the evaluation commands' tests."""

from tests.evaluate.conftest import char_tokenizer, smollm_tokenizer, tiny_lm, word_tokenizer  # noqa: F401
