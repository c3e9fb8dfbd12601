"""How much a folder on a selection changes the entries it keeps, by where they sit (issue 25).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python tools/merged_entries.py niah_single_2 0 0.05 \\
        kvzip kvzip+cam,kvzip+d2o_merge,kvzip+keepkv

Prefills sample ``IDX`` of a synthetic RULER task (2,048 tokens), compresses it with the plain
selection (``BASE``, e.g. ``kvzip``) and with each ``BASE+folder``, and reports for every kept entry
(all layers and KV heads) the relative change of its value ``‖v' − v‖ / ‖v‖`` and of its β,
grouped by where the entry sits: the answer's tokens (``needle``), the first 4 tokens (``sink``),
the last 8 (``tail``) and the rest. Each kept entry of the plain selection is located in the full
cache by its key (eviction keeps keys as they are). Then every cache answers the sample's question.
A folder that loses what its selection kept shows here *which* entries it overwrote.
"""

from __future__ import annotations

import sys

import torch

import kvfold
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


def changes(full, base, folded, needle: set[int], length: int) -> dict[str, list[float]]:
    """Per group: [entries, summed relative value change, summed |Δβ|]."""
    totals = {g: [0, 0.0, 0.0] for g in GROUPS}
    for layer in range(len(full)):
        full_keys = full[layer].padded()[0][0]
        base_k, base_v, base_beta, base_n = base[layer].padded()
        _, fold_v, fold_beta, fold_n = folded[layer].padded()
        for head in range(full_keys.shape[0]):
            n = int(base_n[0, head])
            if int(fold_n[0, head]) != n:
                raise SystemExit(f"layer {layer} head {head}: the folder kept {int(fold_n[0, head])} entries, not {n}")
            positions = torch.cdist(base_k[0, head, :n], full_keys[head]).argmin(-1).tolist()
            dv = (fold_v[0, head, :n] - base_v[0, head, :n]).norm(dim=-1) / base_v[0, head, :n].norm(dim=-1)
            db = (fold_beta[0, head, :n] - base_beta[0, head, :n]).abs()
            for j, p in enumerate(positions):
                row = totals[group_of(p, length, needle)]
                row[0] += 1
                row[1] += float(dv[j])
                row[2] += float(db[j])
    return totals


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
        folded = context.compress(spec, budget=budget)
        totals = changes(context.cache.layers, base.cache.layers, folded.cache.layers, needle, len(ids))
        for group, (count, dv, db) in totals.items():
            mean_dv, mean_db = dv / max(count, 1), db / max(count, 1)
            print(f"  {spec:24s} {group:6s} entries {count:6d}  mean |dv|/|v| {mean_dv:.3f}  mean |dβ| {mean_db:.3f}")
        print(f"  {spec}: answers {folded.answer(sample.question, max_new_tokens=sample.max_new_tokens)[-50:]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
