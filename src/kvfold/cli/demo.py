"""``make demo``: a built-in long context, compressed by each method, answering the same questions."""

from __future__ import annotations

import sys
import time

from kvfold.evaluate.data.logbook import FACTS, build_logbook
from kvfold.methods import RECOMMENDED
from kvfold.runtime.budget import Budget


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
    quiet: bool = False,
    *,
    memory: float | None = None,
    kv_format: str | None = None,
) -> int:
    """Print a table: method, answers correct, KV MB kept vs full, seconds.

    Args:
        methods: see :func:`demo_specs` (default: the full cache, ``kvzip``, ``leverage`` and the
            recommended pipeline; ``"all"``: every method).
        context_tokens: length of the built-in context.
        quiet: print the table alone (no loading line; the table's rows still come as they finish).
        memory: instead of ``budget``, a fraction of the 16-bit full cache's bytes
            (:meth:`~kvfold.pipeline.context.PrefilledContext.compress`).
        kv_format: the storage of the compressed entries (``--kv-bits``).
    """
    from kvfold.pipeline.context import prefill
    from kvfold.runtime.models import load_model

    parsed_budget = Budget.of_memory(memory) if memory is not None else Budget.parse(budget)
    specs = demo_specs(methods)
    if not quiet:
        print(f"Loading {model_spec} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(model_spec, dtype=dtype, device=device)
    context = build_logbook(tokenizer, target_tokens=context_tokens)
    start = time.perf_counter()
    prefilled = prefill(model, tokenizer, context, methods=[s for s in specs if s != "full"] or None)
    print(
        f"Context: {prefilled.context_tokens} tokens, prefilled in {time.perf_counter() - start:.1f}s; "
        f"{len(FACTS)} questions; {'memory' if memory is not None else 'budget'} {parsed_budget}; MB as held "
        "here, 'of 16-bit' against the full cache in 16 bits\n",
        flush=True,
    )
    header = f"{'method':<34} {'correct':>7} {'KV MB':>8} {'full MB':>8} {'of 16-bit':>9} {'seconds':>8}"
    print(header)
    print("-" * len(header))
    for spec in ["full", *[s for s in specs if s != "full"]]:
        t0 = time.perf_counter()
        if spec == "full":
            compressed = prefilled.compress(spec, 1.0)
        else:
            compressed = prefilled.compress(spec, parsed_budget, kv_format=kv_format)
        correct = 0
        for _, question, expected in FACTS:
            answer = compressed.answer(question, max_new_tokens=16)
            correct += expected.lower() in answer.lower()
        seconds = time.perf_counter() - t0
        kv, full = compressed.kv_bytes / 2**20, compressed.kv_bytes_full / 2**20
        label = compressed.method.spec
        print(
            f"{label:<34} {correct:>3}/{len(FACTS):<3} {kv:>8.2f} {full:>8.2f} {compressed.memory_ratio:>9.4f} "
            f"{seconds:>8.1f}",
            flush=True,
        )
    return 0


DEFAULT_METHODS = ("kvzip", "leverage", RECOMMENDED)
"""What ``kvfold demo`` compares with the full cache by default (under 3 minutes on 2 CPU cores)."""

DEMO_SKIP: set[str] = set()
"""Methods left out of ``--methods all`` (none so far)."""
