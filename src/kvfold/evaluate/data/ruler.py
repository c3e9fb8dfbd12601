"""A synthetic RULER-style long-context suite, generated locally and deterministically.

The 13 tasks follow the designs of RULER (Hsieh et al., 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", §3 and Appendix B); the texts, word lists and
documents are this project's own, so nothing is downloaded:

* ``niah_*`` -- needle in a haystack. A needle reads ``"One of the special magic numbers for
  <key> is: <value>."``. Haystacks: ``noise`` (the repeated sentences "The grass is green. The sky
  is blue. ..."), ``essay`` (the project's own prose, ``kvfold/evaluate/data/haystack.txt``, cycled) and
  ``needle`` (the haystack is made of distractor needles). Keys are ``adjective-noun`` words or
  UUIDs, values are 7-digit numbers or UUIDs. As in RULER: ``single_1`` noise/words/numbers,
  ``single_2`` essay/words/numbers, ``single_3`` essay/words/UUIDs, ``multikey_1`` essay with 3
  distractor needles, ``multikey_2`` needle haystack of word keys and numbers, ``multikey_3``
  needle haystack of UUID keys and values, ``multivalue`` 4 values for one key (all must be
  reported), ``multiquery`` 4 keys, all asked.
* ``vt`` -- variable tracking: one chain ``VAR A = 12345.``, ``VAR B = VAR A.``, ... (4 hops)
  hidden in the noise haystack; every variable holding the value must be named.
* ``cwe`` -- common words extraction: a numbered word list in which 10 words occur far more often
  (30 times against at most 3 for the others at RULER's lengths; see :func:`cwe_frequencies`).
* ``fwe`` -- frequent words extraction: "coded" random 6-letter words with Zipf (alpha = 2)
  frequencies behind a most frequent filler ``"..."``; the three most frequent words are asked.
  Counts are ``floor(c / rank**2)`` rather than sampled, so the top three are never tied.
* ``qa_1`` / ``qa_2`` -- questions over generated documents: fictional biographies and company
  profiles. ``qa_1`` asks a fact stated in one biography (SQuAD-like); ``qa_2`` is two-hop
  (HotpotQA-like): the person's biography names an employer whose profile holds the answer.
  The other documents are distractors.

**Length.** ``length`` counts tokens of the given tokenizer (``add_special_tokens=False``) for the
whole exchange, as RULER does::

    tokens(context) + tokens(question) + tokens(answer_prefix) + max_new_tokens
        + PROMPT_RESERVE_TOKENS + reserve_tokens  <=  length

The context is filled (whole haystack units: sentences, list items, documents) up to that bound,
so it ends within one unit of it. ``PROMPT_RESERVE_TOKENS`` (8) covers a BOS token and the
separators around the answer prefix; a chat template's own tokens are not included (pass them as
``reserve_tokens``). With SmolLM2's tokenizer at 4096 tokens, a NIAH context takes ~3910 tokens
(128 generation tokens, ~40 for question and answer prefix, ~100 with UUID keys), a QA context
~3980 and a VT context ~4000.

**Depth.** Each needle task draws a depth in [0, 1) per sample and stores it on
:attr:`Sample.depth`. The needle holding ``answers[0]`` is inserted at the haystack unit boundary
(a sentence boundary for prose) nearest to that fraction of the haystack's characters, measured
without the needles. Other needles get their own random depths.

**Determinism.** Sample ``i`` of a task depends only on ``(tokenizer, length, seed, task, i)``:
asking for more samples, or for other tasks, leaves it unchanged.

**Differences from RULER.** No worked example is put in the prompts; the QA documents are
generated instead of taken from SQuAD/HotpotQA; depth is measured in characters rather than
tokens; ``niah_single_3`` keeps RULER's word keys with UUID values (``niah_multikey_3`` has UUID
keys and values); the wording of instructions is this project's own.
"""

from __future__ import annotations

import bisect
import random
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from itertools import accumulate
from typing import Any, Protocol

from kvfold.evaluate.data.samples import Sample

__all__ = [
    "NOISE_SENTENCES",
    "PROMPT_RESERVE_TOKENS",
    "RULER_MAX_NEW_TOKENS",
    "RULER_TASKS",
    "count_tokens",
    "cwe_frequencies",
    "generate_ruler",
    "haystack_sentences",
    "load_haystack",
    "token_ids",
]

RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
"""The 13 task names, in RULER's order."""

RULER_MAX_NEW_TOKENS: dict[str, int] = {
    **{task: 128 for task in RULER_TASKS if task.startswith("niah")},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 32,
    "qa_2": 32,
}
"""Generation budget per task: RULER's ``tokens_to_generate`` (used for official RULER files)."""

HEADLINE_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "qa_1",
)
"""The tasks ``--dataset ruler`` runs by default. ``niah_multikey_1`` is left out: SmolLM2-135M
with the full cache answered 0 of 6 probes at 2K tokens (it returns the first needle whatever the
key). Every task stays runnable by name (``ruler:niah_multikey_1``, ``ruler:all``)."""

TASK_HAYSTACKS: dict[str, str] = {
    **{task: "prose" for task in RULER_TASKS if task.startswith("niah")},
    "niah_single_1": "noise",
    "niah_multikey_2": "noise",
    "niah_multikey_3": "noise",
    "vt": "noise",
    "cwe": "noise",
    "fwe": "noise",
    "qa_1": "prose",
    "qa_2": "prose",
}
"""What each task hides its facts in: ``noise`` (repeated filler sentences, a haystack of
distractor needles, word lists) or ``prose`` (English text: the project's essay, or documents)."""

VT_HOPS = 1
"""Assignments after the first in a variable-tracking chain (RULER: 4)."""



PROMPT_RESERVE_TOKENS = 8
"""Tokens kept free for a BOS token and the separators around the answer prefix."""

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


@lru_cache(maxsize=1)
def load_haystack() -> str:
    """The project's prose haystack (``kvfold/evaluate/data/haystack.txt``), read as package data."""
    return resources.files("kvfold.evaluate.data").joinpath("haystack.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    """The prose haystack split into sentences (whitespace normalised), in order."""
    text = " ".join(load_haystack().split())
    return tuple(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if s)


# --- word lists (this project's own) -------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    """The whitespace-separated words of ``text``."""
    return tuple(text.split())


_ADJECTIVES = _words(
    """able amber ancient arctic bashful bitter blazing bold bouncy brave breezy bright brisk broad
    bumpy calm careful cheerful chilly clever cloudy clumsy cozy crisp curly damp dazzling deep dizzy
    drowsy dusty eager early elegant endless fancy fearless fierce fluffy fragile frosty funny fuzzy
    gentle giant glossy golden grand grumpy hasty heavy hollow honest humble hungry icy idle jolly
    juicy lazy lively lonely loud lucky marble mellow merry messy mighty misty modern muddy narrow
    nervous noisy orange pale plain polite proud purple quick quiet rapid rare rough royal rusty
    salty scarlet shaggy sharp shiny silent silky silver sleepy slim smooth snowy spicy steady
    sticky stormy strange sturdy sunny sweet swift tame tender thirsty tidy tiny tough upbeat vast
    velvet violet wary weary wicked windy wise witty wooden zany zesty"""
)
_NOUNS = _words(
    """acorn anchor apple arrow attic badge bakery balloon banjo barrel basket beacon beetle bicycle
    blanket bottle bracelet bucket button cabin cactus camera candle canoe canyon carpet castle
    cellar chimney circus cliff comet compass cookie cottage crayon cricket crown cushion daisy
    desert diamond dolphin donkey dragon eagle easel engine falcon feather fiddle forest fountain
    garden garlic giraffe globe goblet guitar hammer harbor helmet honey island jacket jungle kettle
    kitten ladder lagoon lantern lemon library lizard locket magnet mango meadow mirror mitten
    monkey muffin needle notebook oasis orchard otter paddle palace panda parrot pebble pencil
    pepper piano pillow planet pocket puzzle quilt rabbit raft rainbow robot rocket saddle sailboat
    scarf shadow sparrow spoon squirrel statue teapot temple thimble thunder tiger tractor trumpet
    tulip tunnel turtle umbrella violin volcano wagon walnut whistle window wizard zebra"""
)
_FIRST_NAMES = _words(
    """Ada Alma Anton Basil Bea Bruno Cara Cyril Dora Edgar Elsa Emil Faye Felix Greta Gideon Hana
    Hugo Ines Ivo Jana Jonas Kira Lars Lena Leon Lida Marek Mina Milo Nadia Nils Olga Oscar Petra
    Quentin Rosa Rufus Saga Silas Tamsin Teodor Una Viggo Wanda Xaver Yara Zeno"""
)
_LAST_NAMES = _words(
    """Abernathy Albright Ashdown Bellamy Birchwood Brantley Calloway Carrow Crowther Delacroix
    Dunmore Ellsworth Everly Fairbanks Fenwick Fitzroy Galloway Greaves Gresham Hartwell Hollis
    Holloway Ingram Jessop Kettering Kingsley Lindqvist Lockhart Marlowe Mercer Moncrieff Northcott
    Oakley Pemberton Pryor Quayle Radcliffe Rowntree Sandoval Sherwood Thackeray Thornbury
    Underhill Vance Wainwright Whitlock Yardley Zellner"""
)
_TOWN_STARTS = _words(
    """Alder Amber Ash Birch Black Bright Cold Copper Crow Deer Elm Fern Frost Glen Gold Hazel Iron
    Kings Lark Mill Moss Oak Raven Red Salt Silver Stone Thorn Willow Wolf"""
)
_TOWN_ENDS = _words("bay bridge brook burgh dale field ford gate haven holm lea mere moor port stead vale")
_FIELDS = _words(
    """anthropology architecture astronomy botany chemistry economics engineering geology history
    law linguistics mathematics medicine music philosophy physics psychology sociology statistics
    zoology"""
)
_OCCUPATIONS = _words(
    """architect baker carpenter chemist diplomat editor engineer farmer geologist journalist lawyer
    librarian machinist nurse pharmacist photographer pilot surveyor teacher translator"""
)
_INSTRUMENTS = _words(
    "accordion bassoon cello clarinet drums flute guitar harp harpsichord oboe piano saxophone trombone "
    "trumpet tuba viola violin ukulele"
)
_INDUSTRIES = _words(
    "aviation brewing ceramics fishing furniture glassware insurance mining pharmaceutical publishing "
    "railway shipping software textile timber"
)
_COMPANY_SUFFIXES = _words("Company Works Industries Holdings Group Trading Partners Limited")

# Function words left out of the common-words vocabulary.
_STOPWORDS = frozenset(
    _words(
        """about after again against along also among another because been before being between both
    could does down during each either even every from further have having here into itself just
    less many more most much must never only other ought over same should since some such than that
    their them then there these they this those through under until upon very were what when where
        which while whom whose will with within without would your"""
    )
)


# --- shared mechanics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Question:
    """One question about a context, with its references and the start of its answer."""

    question: str
    answers: tuple[str, ...]
    answer_prefix: str
    depth: float | None = None  # where this question's first needle sits, when not the plan's


@dataclass(frozen=True)
class _Plan:
    """One context before its length is fitted: its questions plus ``build(units) -> context``."""

    questions: tuple[_Question, ...]
    build: Callable[[int], str]
    depth: float | None = None
    min_units: int = 0


class _Stream:
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


def _cycle(units: Sequence[str], start: int, count: int) -> list[str]:
    """``count`` units read cyclically from ``units`` beginning at ``start``."""
    return [units[(start + i) % len(units)] for i in range(count)]


def _insert_at_depths(units: Sequence[str], needles: Sequence[tuple[float, str]], sep: str) -> list[str]:
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


def _fit_units(count_at: Callable[[int], int], budget: int, minimum: int, task: str) -> int:
    """A unit count whose context fits in ``budget`` tokens: the largest, or one within 0.5 % of it.

    Estimates tokens per unit from two probes, then gallops and bisects from the estimate, so a
    long context is tokenised about ten times.
    """
    memo: dict[int, int] = {}

    def tokens(units: int) -> int:
        if units not in memo:
            memo[units] = count_at(units)
        return memo[units]

    if tokens(minimum) > budget:
        raise ValueError(
            f"length is too small for task {task!r}: its smallest context takes {tokens(minimum)} tokens, "
            f"but only {budget} are left for the context; increase length"
        )
    probe = minimum + 64
    per_unit = max((tokens(probe) - tokens(minimum)) / 64, 1e-3)
    guess = minimum + max(int((budget - tokens(minimum)) / per_unit), 0)
    step = max(1, int(abs(budget - tokens(guess)) / per_unit) + 1)
    if tokens(guess) <= budget:
        lo, hi = guess, guess + step
        while tokens(hi) <= budget:
            lo, step = hi, step * 2
            hi = lo + step
    else:
        lo, hi = max(minimum, guess - step), guess
        while tokens(lo) > budget:
            hi, step = lo, step * 2
            lo = max(minimum, hi - step)
    while hi - lo > 1 and budget - tokens(lo) > budget // 200:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
    return lo


def _unique(rng: random.Random, make: Callable[[random.Random], str], count: int, avoid: set[str]) -> list[str]:
    """``count`` distinct items from ``make`` that are not in ``avoid`` (which is updated)."""
    items: list[str] = []
    while len(items) < count:
        item = make(rng)
        if item not in avoid:
            avoid.add(item)
            items.append(item)
    return items


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _join_keys(keys: Sequence[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b, and c"``."""
    if len(keys) <= 2:
        return " and ".join(keys)
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


# --- NIAH ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NiahConfig:
    """A NIAH variant: haystack kind, key and value kinds, and needle counts."""

    haystack: str  # "noise" | "prose" | "needle"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    num_keys: int = 1  # keys that get needles (queried ones first, then distractors)
    num_values: int = 1  # values per key
    num_queries: int = 1  # keys asked about, each in a question of its own


_NIAH_CONFIGS: dict[str, _NiahConfig] = {
    "niah_single_1": _NiahConfig("noise", "words", "numbers"),
    "niah_single_2": _NiahConfig("prose", "words", "numbers"),
    "niah_single_3": _NiahConfig("prose", "words", "uuids"),
    "niah_multikey_1": _NiahConfig("prose", "words", "numbers", num_keys=4),
    "niah_multikey_2": _NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": _NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": _NiahConfig("prose", "words", "numbers", num_values=2),
    "niah_multiquery": _NiahConfig("prose", "words", "numbers", num_keys=4, num_queries=4),
}

_VALUE_TOKENS = {"numbers": 12, "uuids": 40}
"""Decode budget per reported value: a 7-digit number or a UUID with its punctuation."""


SUITE_MAX_NEW_TOKENS: dict[str, int] = {
    **{task: 4 + _VALUE_TOKENS[c.value_kind] * c.num_values for task, c in _NIAH_CONFIGS.items()},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 16,
    "qa_2": 32,
}
"""Greedy decoding limit per task in this suite: what the longest correct answer needs (RULER
gives needle tasks 128 tokens; a small model then repeats itself, and decoding dominates a sweep)."""


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
        parts = set(key.split("-")) if make_key is _word_key else {key}
        if key not in used and not parts & words:
            used.add(key)
            words |= parts
            keys.append(key)
    return keys


def _niah_question(kind: str, key: str, values: Sequence[str], depth: float) -> _Question:
    """The question about one key: "What is the ..." for one value, "What are all the ..." for several."""
    singular = kind.removesuffix("s")
    text = f"the special magic {singular if len(values) == 1 else kind} for {key} mentioned in the provided text"
    if len(values) == 1:
        return _Question(f"\nWhat is {text}?", tuple(values), f"Answer: The {text.removeprefix('the ')} is", depth)
    return _Question(f"\nWhat are all {text}?", tuple(values), f"Answer: The {text.removeprefix('the ')} are", depth)


def _plan_niah(config: _NiahConfig, seed: str) -> _Plan:
    """Needles for the queried keys (and distractor keys) hidden in the chosen haystack."""
    rng = random.Random(seed)
    make_key = _uuid if config.key_kind == "uuids" else _word_key
    make_value = _uuid if config.value_kind == "uuids" else _number
    kind = "UUIDs" if config.value_kind == "uuids" else "numbers"
    used_keys: set[str] = set()
    keys = _distinct_keys(rng, make_key, max(config.num_keys, config.num_queries), used_keys)
    values = _unique(rng, make_value, len(keys) * config.num_values, set())
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
    return _Plan(
        questions=questions,
        build=lambda n: preamble + " ".join(_insert_at_depths(units(n), needles, " ")),
        depth=depth,
    )


def _niah_haystack(
    config: _NiahConfig,
    seed: str,
    rng: random.Random,
    kind: str,
    make_key: Callable[[random.Random], str],
    make_value: Callable[[random.Random], str],
    used_keys: set[str],
) -> Callable[[int], list[str]]:
    """``units(n)``: the first ``n`` haystack units for the config's haystack kind."""
    if config.haystack == "noise":
        return lambda n: _cycle(NOISE_SENTENCES, 0, n)
    if config.haystack == "prose":
        sentences = haystack_sentences()
        start = rng.randrange(len(sentences))
        return lambda n: _cycle(sentences, start, n)

    def distractor(stream_rng: random.Random) -> str:
        key = make_key(stream_rng)
        while key in used_keys:
            key = make_key(stream_rng)
        return _needle(kind, key, make_value(stream_rng))

    return _Stream(f"{seed}/distractors", distractor).take


# --- variable tracking ---------------------------------------------------------------------------


def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _plan_vt(seed: str, num_hops: int) -> _Plan:
    """One assignment chain of ``num_hops`` hops hidden in the noise haystack (RULER: 4 hops)."""
    rng = random.Random(seed)
    value = str(rng.randint(10_000, 99_999))
    names = _unique(rng, _variable_name, num_hops + 1, set())
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
    depth = rng.random()
    later = sorted(rng.uniform(depth, 1.0) for _ in statements[1:])
    needles = list(zip([depth, *later], statements, strict=True))
    preamble = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    question = _Question(
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        tuple(names),
        f"Answer: Following the chain of assignments in the text above, the variables assigned the value {value} are:",
    )
    return _Plan(
        questions=(question,),
        build=lambda n: preamble + " ".join(_insert_at_depths(_cycle(NOISE_SENTENCES, 0, n), needles, " ")),
        depth=depth,
    )


# --- common words extraction ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def _cwe_vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters, no function words) of the prose haystack, sorted."""
    words = set(re.findall(r"\b[a-z]{4,10}\b", load_haystack().lower())) - _STOPWORDS
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


def _plan_cwe(seed: str, num_common: int = 10) -> _Plan:
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

    question = _Question(
        f"\nQuestion: What are the {num_common} most common words in the list above?",
        tuple(common_words),
        f"Answer: The top {num_common} words that appear most often in the list are:",
    )
    return _Plan(
        questions=(question,),
        build=build,
        min_units=4 * num_common,
    )


# --- frequent words extraction -------------------------------------------------------------------


def _coded_words(seed: str) -> _Stream:
    """A prefix-stable stream of distinct random 6-letter "coded" words."""
    seen: set[str] = set()

    def coded_word(rng: random.Random) -> str:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        while word in seen:
            word = "".join(rng.choices(string.ascii_lowercase, k=6))
        seen.add(word)
        return word

    return _Stream(seed, coded_word)


def _plan_fwe(seed: str, alpha: float = 2.0) -> _Plan:
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

    question = _Question(
        "\nQuestion: Ignore the dots '...'. What are the three most frequently appearing coded words "
        "in the text above? Do not explain.",
        tuple(coded.take(3)),
        "Answer: The three most frequently appearing coded words in the text above are:",
    )
    return _Plan(
        questions=(question,),
        build=build,
        min_units=100,  # counts 25 > 11 > 6 > 4 for ranks 2-5: the top three are never tied
    )


# --- QA over generated documents -----------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _person_name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"


def _town(rng: random.Random) -> str:
    return rng.choice(_TOWN_STARTS) + rng.choice(_TOWN_ENDS)


def _company_name(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES).title()} {rng.choice(_NOUNS).title()} {rng.choice(_COMPANY_SUFFIXES)}"


def _person(rng: random.Random, name: str, employer: str) -> dict[str, str]:
    """Facts of a fictional person."""
    return {
        "name": name,
        "city": _town(rng),
        "year": str(rng.randint(1900, 1999)),
        "field": rng.choice(_FIELDS),
        "university": _town(rng),
        "occupation": rng.choice(_OCCUPATIONS),
        "employer": employer,
        "instrument": rng.choice(_INSTRUMENTS),
    }


def _biography(p: Mapping[str, str]) -> str:
    """A biography whose every sentence names the person in full.

    Each fact sits in its own sentence after the full name, so a question about one person can be
    answered by completing a sentence that starts the same way (see :data:`_QA1_QUESTIONS`).
    """
    name = p["name"]
    return (
        f"{name} was born in {p['year']}. {name} grew up in the town of {p['city']}. {name} studied "
        f"{p['field']} at the University of {p['university']}. {name} later worked as "
        f"{_article(p['occupation'])} {p['occupation']} for {p['employer']}. Outside work, {name} "
        f"played the {p['instrument']}."
    )


def _company(rng: random.Random, name: str) -> dict[str, str]:
    """Facts of a fictional company."""
    return {
        "name": name,
        "industry": rng.choice(_INDUSTRIES),
        "year": str(rng.randint(1850, 1995)),
        "founder": _person_name(rng),
        "city": _town(rng),
        "staff": str(rng.randrange(20, 5000, 10)),
    }


def _company_profile(c: Mapping[str, str]) -> str:
    return (
        f"{c['name']} is {_article(c['industry'])} {c['industry']} company founded in {c['year']} by "
        f"{c['founder']}. Its headquarters are in {c['city']}, and it employs about {c['staff']} people."
    )


_QA1_QUESTIONS = (
    ("In which town did {name} grow up?", "city", "{name} grew up in the town of"),
    ("In which year was {name} born?", "year", "{name} was born in"),
    ("What did {name} study at university?", "field", "{name} studied"),
    ("Which instrument did {name} play?", "instrument", "Outside work, {name} played the"),
    ("What did {name} work as?", "occupation", "{name} later worked as"),
)
"""``(question, fact, answer prefix)``: the prefix restates the start of the sentence holding the
fact, as a needle's answer prefix does ("... is"); it names only the person already named in the
question, never the fact. Measured on SmolLM2-135M (full cache, 2K): with a bare ``"Answer:"``
prefix the model answers in the right form with another person's fact (0 of 8)."""
_QA2_QUESTIONS = (
    ("In which city is the company that {name} worked for headquartered?", "city"),
    ("Who founded the company that {name} worked for?", "founder"),
    ("In which year was the company that {name} worked for founded?", "year"),
)


def _distractor_documents(
    seed: str, person_name: str, company_name: str, answer: str
) -> Callable[[int], list[str]]:
    """``docs(n)``: the first ``n`` distractor documents (biographies and company profiles).

    None of them is about the gold person or the gold company, and none contains the answer, so
    the answer occurs in the context exactly once.
    """

    def document(rng: random.Random) -> str:
        text = one_document(rng)
        while answer in text:
            text = one_document(rng)
        return text

    def one_document(rng: random.Random) -> str:
        if rng.random() < 0.5:
            name = _person_name(rng)
            while name == person_name:
                name = _person_name(rng)
            employer = _company_name(rng)
            return _biography(_person(rng, name, employer))
        name = _company_name(rng)
        while name == company_name:
            name = _company_name(rng)
        return _company_profile(_company(rng, name))

    return _Stream(f"{seed}/documents", document).take


def _qa_context(distractors: Callable[[int], list[str]], gold: Sequence[tuple[float, str]], n: int) -> str:
    """Numbered documents: ``n`` distractors with the gold documents inserted at their depths."""
    documents = _insert_at_depths(distractors(n), gold, "\n\n")
    numbered = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(documents))
    return "The following documents are given.\n\n" + numbered


def _askable_questions(person: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The :data:`_QA1_QUESTIONS` whose answer occurs once in the person's biography and nowhere
    in the prose haystack (so the answer occurs in the context exactly once, at any length)."""
    prose = " ".join(load_haystack().split()).lower()
    biography = _biography(person).lower()
    askable = []
    for question in _QA1_QUESTIONS:
        pattern = re.compile(rf"\b{re.escape(person[question[1]].lower())}\b")
        if len(pattern.findall(biography)) == 1 and not pattern.search(prose):
            askable.append(question)
    return askable


def _plan_qa1(seed: str) -> _Plan:
    """A fact about a generated person whose biography is hidden in the prose haystack."""
    rng = random.Random(seed)
    person = _person(rng, _person_name(rng), _company_name(rng))
    while not (askable := _askable_questions(person)):
        person = _person(rng, _person_name(rng), _company_name(rng))
    template, field, sentence_start = rng.choice(askable)
    depth = rng.random()
    sentences = haystack_sentences()
    start = rng.randrange(len(sentences))
    gold = [(depth, _biography(person))]
    asked = _Question(
        "\n\nAnswer the question based on the text above. Only give the answer and no other words."
        f"\n\nQuestion: {template.format(name=person['name'])}",
        (person[field],),
        "Answer: " + sentence_start.format(name=person["name"]),
    )
    preamble = "The biography of a person is hidden in the text below. Memorize it.\n"
    return _Plan(
        questions=(asked,),
        build=lambda n: preamble + " ".join(_insert_at_depths(_cycle(sentences, start, n), gold, " ")),
        depth=depth,
    )


def _plan_qa2(seed: str) -> _Plan:
    """A question about the company a generated person worked for, among generated documents."""
    rng = random.Random(seed)
    company = _company(rng, _company_name(rng))
    person = _person(rng, _person_name(rng), company["name"])
    depth = rng.random()
    template, field = rng.choice(_QA2_QUESTIONS)
    answer = company[field]
    gold = [(depth, _company_profile(company)), (rng.random(), _biography(person))]
    distractors = _distractor_documents(seed, person["name"], company["name"], answer)
    asked = _Question(
        "\n\nAnswer the question based on the given documents. Only give the answer and no other "
        f"words.\n\nQuestion: {template.format(name=person['name'])}",
        (answer,),
        "Answer:",
    )
    return _Plan(
        questions=(asked,),
        build=lambda n: _qa_context(distractors, gold, n),
        depth=depth,
    )


# --- public entry point --------------------------------------------------------------------------


def _plan(task: str, seed: str) -> _Plan:
    """The plan for one context of ``task``."""
    if task in _NIAH_CONFIGS:
        return _plan_niah(_NIAH_CONFIGS[task], seed)
    if task == "vt":
        return _plan_vt(seed, VT_HOPS)
    if task == "cwe":
        return _plan_cwe(seed)
    if task == "fwe":
        return _plan_fwe(seed)
    return _plan_qa1(seed) if task == "qa_1" else _plan_qa2(seed)


def _generate_context(
    tokenizer: TokenizerLike, task: str, length: int, seed: int, index: int, reserve_tokens: int
) -> list[Sample]:
    """Context ``index`` of ``task``, fitted to the token budget, with one sample per question."""
    plan = _plan(task, f"kvfold-ruler/{seed}/{task}/{index}")
    max_new_tokens = SUITE_MAX_NEW_TOKENS[task]
    longest = max(count_tokens(tokenizer, q.question + q.answer_prefix) for q in plan.questions)
    budget = length - longest - max_new_tokens - PROMPT_RESERVE_TOKENS - reserve_tokens
    units = _fit_units(lambda n: count_tokens(tokenizer, plan.build(n)), budget, plan.min_units, task)
    context = plan.build(units)
    base_id = f"{task}/{length}/seed{seed}/{index}"
    return [
        Sample(
            context=context,
            question=q.question,
            answers=q.answers,
            task=task,
            answer_prefix=q.answer_prefix,
            max_new_tokens=max_new_tokens,
            metric="string_match_part" if task.startswith("qa") else "string_match_all",
            sample_id=base_id if len(plan.questions) == 1 else f"{base_id}/q{k}",
            depth=plan.depth if q.depth is None else q.depth,
            length=length,
            haystack=TASK_HAYSTACKS[task],
        )
        for k, q in enumerate(plan.questions)
    ]


def generate_ruler(
    tokenizer: TokenizerLike,
    length: int,
    samples_per_task: int,
    seed: int = 0,
    tasks: Sequence[str] | None = None,
    *,
    reserve_tokens: int = 0,
) -> list[Sample]:
    """Generates the synthetic RULER-style suite at a length measured in the model's tokens.

    Args:
        tokenizer: The model's Hugging Face tokenizer (or any callable returning ``input_ids``).
        length: Token budget of a whole exchange: context, question, answer prefix and
            ``max_new_tokens`` (see the module docstring).
        samples_per_task: Samples per task.
        seed: Generation seed; sample ``i`` of a task depends only on (tokenizer, length, seed, i).
        tasks: Task names from :data:`RULER_TASKS`; all of them when ``None``.
        reserve_tokens: Further tokens to keep free, e.g. for the model's chat template.

    Returns:
        ``samples_per_task`` samples per task, grouped by task in the order given.

    Raises:
        ValueError: On an unknown task name, a non-positive ``samples_per_task``, or a ``length``
            too small for a task's question and smallest context.

    Example:
        >>> samples = generate_ruler(tokenizer, 4096, 10, tasks=["niah_single_1"])  # doctest: +SKIP
        >>> samples[0].answers[0] in samples[0].context  # doctest: +SKIP
        True
    """
    selected = tuple(RULER_TASKS if tasks is None else tasks)
    unknown = [t for t in selected if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; valid tasks: {', '.join(RULER_TASKS)}")
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be a positive int; got {samples_per_task}")
    if length < 1:
        raise ValueError(f"length must be a positive number of tokens; got {length}")
    return [
        sample
        for task in dict.fromkeys(selected)
        for index in range(samples_per_task)
        for sample in _generate_context(tokenizer, task, length, seed, index, reserve_tokens)
    ]
