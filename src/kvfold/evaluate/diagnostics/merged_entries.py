"""How much a folder on a selection changes the entries it keeps, by where they sit (``kvfold merged-entries``).

A context is compressed with the plain selection (``base``, e.g. ``kvzip``) and with each
``base+folder``. For every kept entry (all layers and KV heads) the relative change of its value
``‖v' − v‖ / ‖v‖`` and the change of its β are measured against the full cache's entry at the same
position, grouped by where the entry sits: the answer's tokens (``needle``), the first
:data:`SINK_TOKENS` tokens (``sink``), the last :data:`TAIL_TOKENS` (``tail``) and the rest
(``other``); the plain selection itself changes nothing. Then every cache answers the sample's
question. A folder that loses what its selection kept shows here *which* entries it overwrote.

The kept slots (positions in the full cache, in entry order) come from the compression's own
record (:func:`~kvfold.evaluate.diagnostics.mergemap.compress_recorded`), as ``kvfold mergemap``
reads them, so a folder that reselects its entries (KeepKV) is compared entry for entry.

Example:
    >>> model, tokenizer = kvfold.load_model()
    >>> for line in merged_entries(model, tokenizer, "niah_single_2", 0, 0.05, "kvzip", ["kvzip+keepkv"]):
    ...     print(line)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.evaluate.data.ruler import generate_ruler
from kvfold.evaluate.diagnostics.mergemap import compress_recorded
from kvfold.pipeline.context import PrefilledContext, prefill

__all__ = ["GROUPS", "EntryChanges", "answer_positions", "entry_changes", "group_of", "merged_entries"]

GROUPS = ("needle", "sink", "tail", "other")
"""Where a kept entry sits: on an answer token, among the first tokens, among the last, elsewhere."""

SINK_TOKENS = 4
"""The first tokens of the context (the attention sinks)."""

TAIL_TOKENS = 8
"""The last tokens of the context."""


@dataclass
class EntryChanges:
    """The kept entries of one group and their summed changes against the full cache."""

    entries: int = 0
    value_change: float = 0.0  # Σ ‖v' − v‖ / ‖v‖
    beta_change: float = 0.0  # Σ |β' − β|

    def line(self, spec: str, group: str) -> str:
        """``spec group entries N  mean |dv|/|v| x  mean |dβ| y``, as the report prints it."""
        mean_dv, mean_db = self.value_change / max(self.entries, 1), self.beta_change / max(self.entries, 1)
        return (
            f"  {spec:24s} {group:6s} entries {self.entries:6d}  mean |dv|/|v| {mean_dv:.3f}  mean |dβ| {mean_db:.3f}"
        )


def answer_positions(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], answers: Sequence[str]) -> set[int]:
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
    """The group (:data:`GROUPS`) of a token position in a context of ``length`` tokens."""
    if position in needle:
        return "needle"
    if position < SINK_TOKENS:
        return "sink"
    return "tail" if position >= length - TAIL_TOKENS else "other"


def entry_changes(
    context: PrefilledContext, spec: str, budget: float, needle: set[int], length: int
) -> dict[str, EntryChanges]:
    """Per group, the kept entries of ``spec`` at ``budget`` and their changes against the full cache (batch row 0)."""
    cache, recorder, _ = compress_recorded(context, spec, budget)
    totals = {g: EntryChanges() for g in GROUPS}
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
                group = totals[group_of(p, length, needle)]
                group.entries += 1
                group.value_change += float(dv[j])
                group.beta_change += float(db[j])
    return totals


def merged_entries(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    index: int,
    budget: float,
    base: str,
    folded: Sequence[str],
    *,
    length: int = 2048,
) -> Iterator[str]:
    """The report, line by line: sample ``index`` of a synthetic RULER task, its plain selection and folders.

    Args:
        model, tokenizer: the model (kvfold attention) and its tokenizer.
        task: a RULER task (:data:`~kvfold.evaluate.data.ruler.RULER_TASKS`); index: its sample.
        budget: the budget of every compression.
        base: the plain selection's spec (``kvzip``); folded: the specs of a folder on it (``kvzip+cam``).
        length: the sample's length in tokens.

    Yields:
        The sample's answer tokens, the base's answer, then per folder a line per group (:data:`GROUPS`)
        and its answer.
    """
    sample = generate_ruler(tokenizer, length, index + 1, tasks=[task])[index]
    context = prefill(model, tokenizer, sample.context, methods=[base, *folded])
    ids = context.input_ids[0].tolist()
    needle = answer_positions(tokenizer, ids, list(sample.answers))
    yield f"{task} #{index}: {len(needle)} answer tokens of {len(ids)}, budget {budget}, answers {sample.answers}"
    reply = context.compress(base, budget=budget).answer(sample.question, max_new_tokens=sample.max_new_tokens)
    yield f"{base}: answers {reply[-50:]!r}"
    for spec in folded:
        totals = entry_changes(context, spec, budget, needle, len(ids))
        compressed = context.compress(spec, budget=budget)
        yield from (changes.line(spec, group) for group, changes in totals.items())
        yield f"  {spec}: answers {compressed.answer(sample.question, max_new_tokens=sample.max_new_tokens)[-50:]!r}"
