"""The logbook: a built-in long context with five facts at known depths (``kvfold demo``, the README's
quick start, tests). Deterministic: the same tokenizer and seed give the same text."""

from __future__ import annotations

import random

FACTS = [
    (
        "The special magic number for the lighthouse is 4821.",
        "What is the special magic number for the lighthouse?",
        "4821",
    ),
    ("The special magic number for Lisbon is 7395.", "What is the special magic number for Lisbon?", "7395"),
    (
        "The radio call sign of the expedition is Kestrel.",
        "What is the radio call sign of the expedition?",
        "Kestrel",
    ),
    (
        "The special magic number for the cabin is 2618.",
        "What is the special magic number for the cabin?",
        "2618",
    ),
    (
        "The special magic word for the red balloon is Biscuit.",
        "What is the special magic word for the red balloon?",
        "Biscuit",
    ),
]

_SUBJECTS = [
    "The wind",
    "The tide",
    "The old keeper",
    "A gull",
    "The fog",
    "The generator",
    "The lantern",
    "The cartographer",
    "The second mate",
    "The weather vane",
    "A fishing trawler",
    "The radio",
]
_VERBS = [
    "drifted past",
    "circled",
    "rattled against",
    "settled over",
    "hummed beside",
    "leaned toward",
    "flickered near",
    "waited by",
    "moved along",
    "returned to",
]
_OBJECTS = [
    "the northern cliffs",
    "the harbour wall",
    "the supply shed",
    "the rocky shore",
    "the signal mast",
    "the kelp beds",
    "the narrow pier",
    "the stone stairs",
    "the east window",
    "the chart table",
]
_TAILS = [
    "as the afternoon light faded.",
    "while the crew mended nets.",
    "long before anyone woke.",
    "during the grey hours of the morning.",
    "and nobody paid it much attention.",
    "under a sky the colour of slate.",
    "as the kettle began to whistle.",
    "before the rain returned.",
]


def build_logbook(tokenizer, target_tokens: int = 3000, seed: int = 7) -> str:
    """A deterministic logbook of filler sentences with the FACTS spread at fixed depths."""
    rng = random.Random(seed)
    sentences: list[str] = []
    day = 1
    while True:
        if len(sentences) % 6 == 0:
            sentences.append(f"Logbook, day {day}.")
            day += 1
        sentences.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}")
        if len(sentences) % 40 == 0 and len(tokenizer(" ".join(sentences)).input_ids) > target_tokens * 0.95:
            break
    for i, (fact, _, _) in enumerate(FACTS):
        depth = (i + 0.5) / len(FACTS)
        sentences.insert(int(depth * len(sentences)), fact)
    return " ".join(sentences)
