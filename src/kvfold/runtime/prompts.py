"""Prompts: how a context and a question become token ids, below the methods and the pipeline.

The pipeline formats every context with :func:`build_prompt`; methods that run extra passes over
a prefilled context (KVzip's and Attention Matching's repeat passes, AM's self-study turns) need
the same template pieces, so they take them from here: :func:`template_parts` splits the template
around a user message, :func:`context_text_ids` strips its head from a prefilled row, and
:func:`turn_ids` closes the context's user turn with a message and opens the assistant's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvfold.runtime.errors import UserError

__all__ = ["PromptParts", "build_prompt", "context_text_ids", "encode", "template_parts", "turn_ids"]


@dataclass
class PromptParts:
    """A prompt split where compression stops: ``context`` is compressed, ``suffix`` is appended."""

    context: str
    suffix: str


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    answer_prefix: str = "",
    *,
    use_chat_template: bool | None = None,
) -> PromptParts:
    """Format context and question as one user turn (chat template when the model has one).

    The split point is right after the context text, so the question, the end of the user
    turn, the assistant header and the answer prefix form the suffix.
    """
    marker = "\u241e"  # a character that tokenizers and templates leave alone
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template:
        if not has_template:
            raise UserError("this tokenizer has no chat template; pass use_chat_template=False")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + marker + "\n\n" + question}],
            tokenize=False,
            add_generation_prompt=True,
        )
    else:
        rendered = context + marker + "\n\n" + question + "\n"
    head, tail = rendered.split(marker, 1)
    return PromptParts(context=head, suffix=tail + answer_prefix)


def encode(tokenizer: PreTrainedTokenizerBase, text: str, *, special: bool) -> list[int]:
    """Token ids of ``text``; ``special`` adds the tokenizer's special tokens (BOS)."""
    return tokenizer(text, add_special_tokens=special).input_ids


def template_parts(tokenizer: Any, text: str) -> tuple[str, str, str]:
    """``(head, before, tail)``: the template before the context, the text between the context and
    a user message ``text`` appended to it, and the end of the user turn plus assistant header."""
    marker = "\u241f"
    parts = build_prompt(tokenizer, "", marker)
    before, tail = parts.suffix.split(marker, 1)
    return parts.context, before + text, tail


def context_text_ids(tokenizer: Any, row_ids: list[int]) -> tuple[list[int], bool]:
    """The context's own tokens (template head removed) and whether the row used the template."""
    head, _, _ = template_parts(tokenizer, "")
    prefix = encode(tokenizer, head, special=True)
    if prefix and row_ids[: len(prefix)] == prefix:
        return row_ids[len(prefix) :], True
    return row_ids, False


def turn_ids(tokenizer: Any, message: str, templated: bool) -> list[int]:
    """Tokens that end the context's user turn with ``message`` and open the assistant turn."""
    if templated:
        _, before, tail = template_parts(tokenizer, message)
        return encode(tokenizer, before, special=False) + (encode(tokenizer, tail, special=False) if tail else [])
    return encode(tokenizer, "\n\n" + message + "\n", special=False)
