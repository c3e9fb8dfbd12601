"""The plans of the synthetic RULER tasks: needles (NIAH), variable tracking, common and frequent words.

A task's plan (:class:`Plan`) holds the questions about one context and ``build(units)``, which
writes the context with a given number of haystack units; :mod:`kvfold.evaluate.data.ruler` fits
the unit count to the token budget. The question-answering tasks are in
:mod:`kvfold.evaluate.data.ruler_documents`. The designs follow RULER (Hsieh et al., 2024, §3 and
Appendix B); see :mod:`kvfold.evaluate.data.ruler` for the suite and where it departs from RULER.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvfold.evaluate.data.text import (
    NOISE_SENTENCES,
    Stream,
    cycle,
    haystack_sentences,
    insert_at_depths,
    load_haystack,
    unique,
    word_list,
)

__all__ = [
    "NIAH_CONFIGS",
    "VALUE_TOKENS",
    "NiahConfig",
    "Plan",
    "Question",
    "cwe_frequencies",
    "plan_cwe",
    "plan_fwe",
    "plan_niah",
    "plan_vt",
    "word_key",
]


@dataclass(frozen=True)
class Question:
    """One question about a context, with its references and the start of its answer."""

    question: str
    answers: tuple[str, ...]
    answer_prefix: str
    depth: float | None = None  # where this question's first needle sits, when not the plan's


@dataclass(frozen=True)
class Plan:
    """One context before its length is fitted: its questions plus ``build(units) -> context``."""

    questions: tuple[Question, ...]
    build: Callable[[int], str]
    depth: float | None = None
    min_units: int = 0


def word_key(rng: random.Random) -> str:
    """An ``adjective-noun`` key, e.g. ``silky-crown``."""
    return f"{rng.choice(word_list('adjectives'))}-{rng.choice(word_list('nouns'))}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


# --- NIAH ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NiahConfig:
    """A NIAH variant: haystack kind, key and value kinds, and needle counts."""

    haystack: str  # "noise" | "prose" | "needle"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    num_keys: int = 1  # keys that get needles (queried ones first, then distractors)
    num_values: int = 1  # values per key
    num_queries: int = 1  # keys asked about, each in a question of its own


NIAH_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("prose", "words", "numbers"),
    "niah_single_3": NiahConfig("prose", "words", "uuids"),
    "niah_multikey_1": NiahConfig("prose", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("prose", "words", "numbers", num_values=2),
    "niah_multiquery": NiahConfig("prose", "words", "numbers", num_keys=4, num_queries=4),
}
"""The NIAH variants by task name, as in RULER."""

VALUE_TOKENS = {"numbers": 12, "uuids": 40}
"""Decode budget per reported value: a 7-digit number or a UUID with its punctuation."""


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _distinct_keys(
    rng: random.Random, make_key: Callable[[random.Random], str], count: int, used: set[str]
) -> list[str]:
    """``count`` keys of which no two share a word (``silky-crown`` never beside ``silky-fiddle``)."""
    words: set[str] = set()
    keys: list[str] = []
    while len(keys) < count:
        key = make_key(rng)
        parts = set(key.split("-")) if make_key is word_key else {key}
        if key not in used and not parts & words:
            used.add(key)
            words |= parts
            keys.append(key)
    return keys


def _niah_question(kind: str, key: str, values: Sequence[str], depth: float) -> Question:
    """The question about one key: "What is the ..." for one value, "What are all the ..." for several."""
    singular = kind.removesuffix("s")
    text = f"the special magic {singular if len(values) == 1 else kind} for {key} mentioned in the provided text"
    if len(values) == 1:
        return Question(f"\nWhat is {text}?", tuple(values), f"Answer: The {text.removeprefix('the ')} is", depth)
    return Question(f"\nWhat are all {text}?", tuple(values), f"Answer: The {text.removeprefix('the ')} are", depth)


def plan_niah(config: NiahConfig, seed: str) -> Plan:
    """Needles for the queried keys (and distractor keys) hidden in the chosen haystack."""
    rng = random.Random(seed)
    make_key = _uuid if config.key_kind == "uuids" else word_key
    make_value = _uuid if config.value_kind == "uuids" else _number
    kind = "UUIDs" if config.value_kind == "uuids" else "numbers"
    used_keys: set[str] = set()
    keys = _distinct_keys(rng, make_key, max(config.num_keys, config.num_queries), used_keys)
    values = unique(rng, make_value, len(keys) * config.num_values, set())
    depth = rng.random()
    needles: list[tuple[float, str]] = []
    key_depths: list[float] = []
    for k, key in enumerate(keys):
        for v in range(config.num_values):
            needle_depth = depth if not needles else rng.random()
            needles.append((needle_depth, _needle(kind, key, values[k * config.num_values + v])))
            if v == 0:
                key_depths.append(needle_depth)
    questions = tuple(
        _niah_question(kind, key, values[k * config.num_values : (k + 1) * config.num_values], key_depths[k])
        for k, key in enumerate(keys[: config.num_queries])
    )
    units = _niah_haystack(config, seed, rng, kind, make_key, make_value, used_keys)
    preamble = (
        f"A few special magic {kind} are hidden in the text below. "
        f"Memorize them; you will be asked about the {kind} afterwards.\n"
    )
    return Plan(
        questions=questions,
        build=lambda n: preamble + " ".join(insert_at_depths(units(n), needles, " ")),
        depth=depth,
    )


def _niah_haystack(
    config: NiahConfig,
    seed: str,
    rng: random.Random,
    kind: str,
    make_key: Callable[[random.Random], str],
    make_value: Callable[[random.Random], str],
    used_keys: set[str],
) -> Callable[[int], list[str]]:
    """``units(n)``: the first ``n`` haystack units for the config's haystack kind."""
    if config.haystack == "noise":
        return lambda n: cycle(NOISE_SENTENCES, 0, n)
    if config.haystack == "prose":
        sentences = haystack_sentences()
        start = rng.randrange(len(sentences))
        return lambda n: cycle(sentences, start, n)

    def distractor(stream_rng: random.Random) -> str:
        key = make_key(stream_rng)
        while key in used_keys:
            key = make_key(stream_rng)
        return _needle(kind, key, make_value(stream_rng))

    return Stream(f"{seed}/distractors", distractor).take


# --- variable tracking ---------------------------------------------------------------------------


def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def plan_vt(seed: str, num_hops: int) -> Plan:
    """One assignment chain of ``num_hops`` hops hidden in the noise haystack (RULER: 4 hops)."""
    rng = random.Random(seed)
    value = str(rng.randint(10_000, 99_999))
    names = unique(rng, _variable_name, num_hops + 1, set())
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
    depth = rng.random()
    later = sorted(rng.uniform(depth, 1.0) for _ in statements[1:])
    needles = list(zip([depth, *later], statements, strict=True))
    preamble = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    asked = Question(
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        tuple(names),
        f"Answer: Following the chain of assignments in the text above, the variables assigned the value {value} are:",
    )

    def build(units: int) -> str:
        return preamble + " ".join(insert_at_depths(cycle(NOISE_SENTENCES, 0, units), needles, " "))

    return Plan((asked,), build, depth)


# --- common words extraction ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def _cwe_vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters, no function words) of the prose haystack, sorted."""
    words = set(re.findall(r"\b[a-z]{4,10}\b", load_haystack().lower())) - frozenset(word_list("stopwords"))
    return tuple(sorted(words))


@lru_cache(maxsize=1)
def _cwe_answer_candidates() -> tuple[str, ...]:
    """Vocabulary words that are no prefix of another word (so "tide" never hides in "tides")."""
    vocab = _cwe_vocabulary()
    return tuple(w for w, nxt in zip(vocab, (*vocab[1:], ""), strict=True) if not nxt.startswith(w))


def cwe_frequencies(num_items: int, num_rare_words: int, num_common: int = 10) -> tuple[int, int]:
    """How often each common word, and at most each rare word, occurs in a CWE list.

    RULER's contrast is 30 against 3. Short lists scale both down (a common word takes at most
    1/20 of the list); long lists that would run out of distinct rare words repeat each rare word
    more often and keep common words at least three times as frequent.

    Args:
        num_items: Length of the list.
        num_rare_words: Distinct words available for the rare part.
        num_common: Number of common words.

    Returns:
        ``(common_count, max_rare_count)`` with ``common_count > max_rare_count``.
    """
    common = min(30, max(2, num_items // 20))
    rare = max(1, common // 10)
    while num_items - num_common * common > rare * num_rare_words:
        rare += 1
        common = max(common, 3 * rare)
    return common, rare


def plan_cwe(seed: str, num_common: int = 10) -> Plan:
    """A numbered word list where ``num_common`` words are clearly the most frequent."""
    rng = random.Random(seed)
    common_words = rng.sample(_cwe_answer_candidates(), num_common)
    rare_words = [w for w in _cwe_vocabulary() if w not in set(common_words)]
    rng.shuffle(rare_words)

    def build(num_items: int) -> str:
        common, rare = cwe_frequencies(num_items, len(rare_words), num_common)
        items = [w for w in common_words for _ in range(common)]
        slots = num_items - len(items)
        for i in range(-(-slots // rare)):  # ceil: the last rare word may occur fewer times
            items += [rare_words[i]] * min(rare, slots - i * rare)
        random.Random(f"{seed}/order").shuffle(items)
        listing = " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))
        return (
            "Below is a numbered list of words. Some words occur more often than others; "
            "memorize the ones that occur most often.\n" + listing
        )

    asked = Question(
        f"\nQuestion: What are the {num_common} most common words in the list above?",
        tuple(common_words),
        f"Answer: The top {num_common} words that appear most often in the list are:",
    )
    return Plan((asked,), build, min_units=4 * num_common)


# --- frequent words extraction -------------------------------------------------------------------


def _coded_words(seed: str) -> Stream:
    """A prefix-stable stream of distinct random 6-letter "coded" words."""
    seen: set[str] = set()

    def coded_word(rng: random.Random) -> str:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        while word in seen:
            word = "".join(rng.choices(string.ascii_lowercase, k=6))
        seen.add(word)
        return word

    return Stream(seed, coded_word)


def plan_fwe(seed: str, alpha: float = 2.0) -> Plan:
    """Coded words with Zipf counts ``floor(c / rank**alpha)``; rank 1 is the filler ``"..."``."""
    coded = _coded_words(f"{seed}/vocabulary")

    def build(top_count: int) -> str:
        counts = []
        while (count := int(top_count / (len(counts) + 1) ** alpha)) > 0:
            counts.append(count)
        words = ["...", *coded.take(len(counts) - 1)]
        items = [word for word, count in zip(words, counts, strict=True) for _ in range(count)]
        random.Random(f"{seed}/order").shuffle(items)
        preamble = "Read the coded text below and keep count of how often each coded word occurs.\n"
        return preamble + " ".join(items)

    asked = Question(
        "\nQuestion: Ignore the dots '...'. What are the three most frequently appearing coded words "
        "in the text above? Do not explain.",
        tuple(coded.take(3)),
        "Answer: The three most frequently appearing coded words in the text above are:",
    )
    # counts 25 > 11 > 6 > 4 for ranks 2-5: the top three are never tied
    return Plan((asked,), build, min_units=100)
