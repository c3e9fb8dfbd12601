"""``make demo``: a built-in long context, compressed by each method, answering the same questions."""

from __future__ import annotations

import random
import time

from kvfold.methods import RECOMMENDED
from kvfold.runtime.budget import Budget

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


def build_context(tokenizer, target_tokens: int = 3000, seed: int = 7) -> str:
    """A deterministic logbook of filler sentences with the FACTS spread at fixed depths."""
    rng = random.Random(seed)
    sentences: list[str] = []
    day = 1
    while True:
        if len(sentences) % 6 == 0:
            sentences.append(f"Logbook, day {day}.")
            day += 1
        sentences.append(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        )
        if len(sentences) % 40 == 0 and len(tokenizer(" ".join(sentences)).input_ids) > target_tokens * 0.95:
            break
    for i, (fact, _, _) in enumerate(FACTS):
        depth = (i + 0.5) / len(FACTS)
        sentences.insert(int(depth * len(sentences)), fact)
    return " ".join(sentences)


def demo_specs(methods: str | None = None) -> list[str]:
    """The specs the demo compares with the full cache.

    ``None``: :data:`DEFAULT_METHODS` (``kvzip``, ``leverage`` and the recommended pipeline,
    :data:`kvfold.methods.RECOMMENDED`); ``"all"``: every registered method that runs alone (wrappers
    and folders only compose); anything else: a comma-separated list of specs.
    """
    from kvfold.methods import available_methods, split_specs

    if methods is None:
        return list(DEFAULT_METHODS)
    if methods.strip().lower() == "all":
        return [c.name for c in available_methods() if c.role not in ("wrapper", "folder") and c.name not in DEMO_SKIP]
    return split_specs(methods)


def run_demo(
    model_spec: str = "smollm2-135m",
    budget: str = "0.1",
    methods: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    context_tokens: int = 3000,
) -> int:
    """Print a table: method, answers correct, KV MB kept vs full, seconds.

    Args:
        methods: see :func:`demo_specs` (default: the full cache, ``kvzip``, ``leverage`` and the
            recommended pipeline; ``"all"``: every method).
        context_tokens: length of the built-in context.
    """
    from kvfold import load_model, prefill

    parsed_budget = Budget.parse(budget)
    specs = demo_specs(methods)
    print(f"Loading {model_spec} ...", flush=True)
    model, tokenizer = load_model(model_spec, dtype=dtype, device=device)
    context = build_context(tokenizer, target_tokens=context_tokens)
    start = time.perf_counter()
    prefilled = prefill(model, tokenizer, context, methods=[s for s in specs if s != "full"] or None)
    print(
        f"Context: {prefilled.context_tokens} tokens, prefilled in {time.perf_counter() - start:.1f}s; "
        f"{len(FACTS)} questions; budget {parsed_budget}\n",
        flush=True,
    )
    header = f"{'method':<28} {'correct':>7} {'KV MB':>8} {'full MB':>8} {'ratio':>6} {'seconds':>8}"
    print(header)
    print("-" * len(header))
    for spec in ["full", *[s for s in specs if s != "full"]]:
        t0 = time.perf_counter()
        compressed = prefilled.compress(spec, 1.0 if spec == "full" else parsed_budget)
        correct = 0
        for _, question, expected in FACTS:
            answer = compressed.answer(question, max_new_tokens=16)
            correct += expected.lower() in answer.lower()
        seconds = time.perf_counter() - t0
        kv, full = compressed.kv_bytes / 2**20, compressed.kv_bytes_full / 2**20
        print(
            f"{spec:<28} {correct:>3}/{len(FACTS):<3} {kv:>8.2f} {full:>8.2f} {kv / full:>6.3f} {seconds:>8.1f}",
            flush=True,
        )
    return 0


DEFAULT_METHODS = ("kvzip", "leverage", RECOMMENDED)
"""What ``kvfold demo`` compares with the full cache by default (under 3 minutes on 2 CPU cores)."""

DEMO_SKIP: set[str] = set()
"""Methods left out of ``--methods all`` (none so far)."""
