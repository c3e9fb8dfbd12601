"""The text synthetic contexts are made of: tokens, haystacks, word lists and needles at depths.

* Token counting with any Hugging Face-style tokenizer (:func:`token_ids`, :func:`count_tokens`).
* The two haystacks of the RULER suite: RULER's noise sentences (:data:`NOISE_SENTENCES`) and the
  project's own prose (``kvfold/evaluate/data/haystack.txt``, :func:`load_haystack`).
* The suite's word lists, shipped as package data (``kvfold/evaluate/data/ruler_words.txt``,
  :func:`word_list`).
* The mechanics every task shares: prefix-stable random streams (:class:`Stream`), haystacks read
  cyclically (:func:`cycle`), needles inserted at character depths (:func:`insert_at_depths`), and
  distinct random items (:func:`unique`).
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from importlib import resources
from itertools import accumulate
from typing import Any, Protocol

__all__ = [
    "NOISE_SENTENCES",
    "Stream",
    "TokenizerLike",
    "count_tokens",
    "cycle",
    "haystack_sentences",
    "insert_at_depths",
    "load_haystack",
    "token_ids",
    "unique",
    "word_list",
]

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
"""RULER's noise haystack, repeated as needed."""


class TokenizerLike(Protocol):
    """Anything called like a Hugging Face tokenizer that returns ``input_ids``."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...


def token_ids(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens.

    Args:
        tokenizer: A Hugging Face tokenizer, or any callable returning an object (or mapping) with
            ``input_ids``.
        text: Text to encode.

    Returns:
        ``tokenizer(text, add_special_tokens=False).input_ids`` as a list.
    """
    encoding = tokenizer(text, add_special_tokens=False)
    return list(encoding["input_ids"] if isinstance(encoding, Mapping) else encoding.input_ids)


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Number of tokens of ``text`` without special tokens (see :func:`token_ids`)."""
    return len(token_ids(tokenizer, text))


def _package_text(name: str) -> str:
    """A text file shipped in ``kvfold/evaluate/data``."""
    return resources.files("kvfold.evaluate.data").joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def load_haystack() -> str:
    """The project's prose haystack (``kvfold/evaluate/data/haystack.txt``), read as package data."""
    return _package_text("haystack.txt")


@lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    """The prose haystack split into sentences (whitespace normalised), in order."""
    text = " ".join(load_haystack().split())
    return tuple(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if s)


@lru_cache(maxsize=1)
def _word_lists() -> dict[str, tuple[str, ...]]:
    """Every list of ``ruler_words.txt``: a ``[name]`` line starts one, the words after it follow."""
    lists: dict[str, tuple[str, ...]] = {}
    name = None
    for line in _package_text("ruler_words.txt").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1]
            lists[name] = ()
        elif name is not None:
            lists[name] += tuple(line.split())
    return lists


def word_list(name: str) -> tuple[str, ...]:
    """One of the suite's word lists (``adjectives``, ``nouns``, ``first_names``, ...), in file order.

    Raises:
        KeyError: No list of that name in ``ruler_words.txt``.
    """
    return _word_lists()[name]


class Stream:
    """A prefix-stable lazy sequence: item ``i`` never depends on how many items are asked for."""

    def __init__(self, seed: str, make: Callable[[random.Random], str]) -> None:
        self._rng = random.Random(seed)
        self._make = make
        self._items: list[str] = []

    def take(self, count: int) -> list[str]:
        """The first ``count`` items."""
        while len(self._items) < count:
            self._items.append(self._make(self._rng))
        return self._items[:count]


def cycle(units: Sequence[str], start: int, count: int) -> list[str]:
    """``count`` units read cyclically from ``units`` beginning at ``start``."""
    return [units[(start + i) % len(units)] for i in range(count)]


def insert_at_depths(units: Sequence[str], needles: Sequence[tuple[float, str]], sep: str) -> list[str]:
    """Inserts needles between units at the boundaries nearest to their character depths.

    Args:
        units: Haystack units (sentences, list items, documents), joined later with ``sep``.
        needles: ``(depth, text)`` pairs; ``depth`` is the fraction of the haystack's characters
            (without needles) that should precede the needle.
        sep: The separator the caller will join with; counted in the character offsets.

    Returns:
        Units and needles in order. Needles at the same boundary keep their order in ``needles``
        when their depths are equal and are otherwise sorted by depth.
    """
    offsets = [0, *accumulate(len(u) + len(sep) for u in units)]  # chars before boundary b
    total = max(offsets[-1] - len(sep), 0)
    slots: dict[int, list[str]] = {}
    for depth, text in sorted(needles, key=lambda needle: needle[0]):
        target = depth * total
        b = min(bisect.bisect_left(offsets, target), len(units))
        if b > 0 and target - offsets[b - 1] <= offsets[b] - target:
            b -= 1
        slots.setdefault(b, []).append(text)
    pieces: list[str] = []
    for b in range(len(units) + 1):
        pieces.extend(slots.get(b, ()))
        if b < len(units):
            pieces.append(units[b])
    return pieces


def unique(rng: random.Random, make: Callable[[random.Random], str], count: int, avoid: set[str]) -> list[str]:
    """``count`` distinct items from ``make`` that are not in ``avoid`` (which is updated)."""
    items: list[str] = []
    while len(items) < count:
        item = make(rng)
        if item not in avoid:
            avoid.add(item)
            items.append(item)
    return items
