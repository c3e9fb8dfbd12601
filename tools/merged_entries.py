"""How much a folder on a selection changes the entries it keeps, by where they sit (issue 25).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python tools/merged_entries.py niah_single_2 0 0.05 \\
        kvzip kvzip+cam,kvzip+d2o_merge,kvzip+keepkv

Prefills sample ``IDX`` of a synthetic RULER task (2,048 tokens), compresses it with the plain
selection (``BASE``, e.g. ``kvzip``) and with each ``BASE+folder``, and reports for every kept entry
(all layers and KV heads) the relative change of its value ``‖v' − v‖ / ‖v‖`` and of its β
against the full cache's entry at the same position,
grouped by where the entry sits: the answer's tokens (``needle``), the first 4 tokens (``sink``),
the last 8 (``tail``) and the rest; the plain selection itself changes nothing. Then every cache
answers the sample's question.
A folder that loses what its selection kept shows here *which* entries it overwrote.
"""

from __future__ import annotations

import sys

import kvfold
from kvfold.evaluate.mergemap import compress_recorded
from kvfold.evaluate.ruler import generate_ruler

GROUPS = ("needle", "sink", "tail", "other")


def answer_positions(tokenizer, ids: list[int], answers: list[str]) -> set[int]:
    """Token positions whose decoded text overlaps an occurrence of an answer string."""
    text, spans = "", []
    for i in range(len(ids)):
        piece = tokenizer.decode(ids[: i + 1])
        spans.append((len(text), len(piece)))
        text = piece
    found: set[int] = set()
    for answer in answers:
        start = text.find(answer)
        while start >= 0:
            found |= {i for i, (lo, hi) in enumerate(spans) if lo < start + len(answer) and hi > start}
            start = text.find(answer, start + 1)
    return found


def group_of(position: int, length: int, needle: set[int]) -> str:
    if position in needle:
        return "needle"
    if position < 4:
        return "sink"
    return "tail" if position >= length - 8 else "other"


def changes(context, spec: str, budget: float, needle: set[int], length: int) -> tuple[dict[str, list[float]], object]:
    """Per group: [entries, summed relative value change, summed |Δβ|] against the full cache.

    The kept slots (positions in the full cache, in entry order) come from the compression's own
    record (:func:`kvfold.evaluate.mergemap.compress_recorded`), as ``kvfold mergemap`` reads them.
    """
    cache, recorder, _ = compress_recorded(context, spec, budget)
    totals = {g: [0, 0.0, 0.0] for g in GROUPS}
    for layer, (keep, lengths) in sorted(recorder.kept_slots.items()):
        _, full_v, full_beta, _ = context.cache.layers[layer].padded()
        _, fold_v, fold_beta, _ = cache.layers[layer].padded()
        for head in range(keep.shape[1]):
            n = int(lengths[0, head])
            positions = keep[0, head, :n]
            before = full_v[0, head, positions]
            dv = (fold_v[0, head, :n] - before).norm(dim=-1) / before.norm(dim=-1)
            db = (fold_beta[0, head, :n] - full_beta[0, head, positions]).abs()
            for j, p in enumerate(positions.tolist()):
                row = totals[group_of(p, length, needle)]
                row[0] += 1
                row[1] += float(dv[j])
                row[2] += float(db[j])
    return totals, cache


def main(argv: list[str]) -> None:
    if len(argv) != 5:
        raise SystemExit(__doc__)
    task, index, budget, base_spec, folded_specs = argv[0], int(argv[1]), float(argv[2]), argv[3], argv[4].split(",")
    model, tokenizer = kvfold.load_model()
    sample = generate_ruler(tokenizer, 2048, index + 1, tasks=[task])[index]
    context = kvfold.prefill(model, tokenizer, sample.context, methods=[base_spec, *folded_specs])
    ids = context.input_ids[0].tolist()
    needle = answer_positions(tokenizer, ids, list(sample.answers))
    print(f"{task} #{index}: {len(needle)} answer tokens of {len(ids)}, budget {budget}, answers {sample.answers}")
    base = context.compress(base_spec, budget=budget)
    reply = base.answer(sample.question, max_new_tokens=sample.max_new_tokens)
    print(f"{base_spec}: answers {reply[-50:]!r}")
    for spec in folded_specs:
        totals, _ = changes(context, spec, budget, needle, len(ids))
        folded = context.compress(spec, budget=budget)
        for group, (count, dv, db) in totals.items():
            mean_dv, mean_db = dv / max(count, 1), db / max(count, 1)
            print(f"  {spec:24s} {group:6s} entries {count:6d}  mean |dv|/|v| {mean_dv:.3f}  mean |dβ| {mean_db:.3f}")
        print(f"  {spec}: answers {folded.answer(sample.question, max_new_tokens=sample.max_new_tokens)[-50:]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
