"""The pieces of a fidelity measurement: the continuation teacher-forced after a context, and the errors.

:mod:`kvfold.evaluate.running.fidelity` runs each continuation over the full cache and over every
compressed one; this module makes the continuations (:func:`continuations`; ``"answer"``: the
question and reference answer, ``"next"``: the document's held-out end), says how they are fed
(:func:`decode_schedule`), and compares two runs of one (:func:`compare_runs`: ``rel_error``,
``nll_delta``, ``kl``) and two caches of one context (:func:`block_errors`: ``block_error``, the
numerical error of the compressed cache itself, ZSMerge §4.3, Fig. 4; Attention Matching's eq. 1
on held-out queries).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.methods import ComposedMethod
from kvfold.pipeline.context import PrefilledContext, build_prompt, check_length, encode, prefill
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError

__all__ = [
    "Continuation",
    "block_errors",
    "block_outputs",
    "compare_runs",
    "context_blocks",
    "continuations",
    "decode_schedule",
    "reference_answer",
]


@dataclass
class Continuation:
    """One prefilled context and the tokens teacher-forced after it."""

    sample_id: str
    task: str
    context: PrefilledContext
    ids: list[int]
    scored: list[bool]


def reference_answer(sample: Sample) -> str:
    """The answer text teacher-forced in ``"answer"`` mode (every answer for ``string_match_all``)."""
    text = ", ".join(sample.answers) if sample.metric == "string_match_all" else sample.answers[0]
    prefix = sample.answer_prefix
    return (" " if prefix and not prefix[-1].isspace() else "") + text


def continuations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    keys: Sequence[str],
    mode: str,
    next_tokens: int,
    methods: list[ComposedMethod],
    finished: set[str] = frozenset(),
) -> Iterator[Continuation]:
    """Yield one :class:`Continuation` per sample (per distinct context in ``"next"`` mode).

    ``keys`` are the samples' ids (:func:`~kvfold.evaluate.running.sweep.sample_keys` of the whole sweep);
    samples whose key is in ``finished`` are passed over before anything is prefilled.
    """
    key_of = {id(s): k for s, k in zip(samples, keys, strict=True)}
    prefilled: dict[tuple[str, bool], PrefilledContext] = {}
    seen: set[str] = set()
    for sample in (s for _, group in group_by_context(samples) for s in group):
        key = key_of[id(sample)]
        if mode == "next" and sample.context in seen:
            continue
        seen.add(sample.context)
        if key in finished:
            continue
        if mode == "answer":
            template = None if sample.chat_template else False
            cache_key = (sample.context, sample.chat_template)
            if cache_key not in prefilled:
                prefilled.clear()  # keep one prefilled context alive at a time
                prefilled[cache_key] = prefill(
                    model, tokenizer, sample.context, use_chat_template=template, methods=methods
                )
            context = prefilled[cache_key]
            suffix = build_prompt(
                tokenizer, "", sample.question.lstrip(), sample.answer_prefix, use_chat_template=template
            ).suffix
            suffix_ids = encode(tokenizer, suffix, special=False)
            answer_ids = encode(tokenizer, reference_answer(sample), special=False)
            if not answer_ids:
                raise UserError(f"sample {key!r}: the reference answer has no tokens")
            ids, scored = suffix_ids + answer_ids, [False] * len(suffix_ids) + [True] * len(answer_ids)
        else:
            doc = encode(tokenizer, sample.context, special=False)
            if len(doc) < next_tokens + 16:
                raise UserError(
                    f"sample {key!r}: the context has {len(doc)} tokens, too few to hold out "
                    f"{next_tokens} (lower next_tokens)"
                )
            head = tokenizer.decode(doc[:-next_tokens])
            context = prefill(model, tokenizer, head, use_chat_template=False, methods=methods)
            ids, scored = doc[-next_tokens:], [False] + [True] * (next_tokens - 1)
        check_length(model, context.input_ids.shape[1] + len(ids))
        yield Continuation(key, sample.task, context, ids, scored)


def decode_schedule(scored: Sequence[bool], online: bool) -> list[int]:
    """How many continuation tokens each forward takes.

    Offline the whole continuation is one forward. Online, as during generation, the unscored lead
    (the prompt: question and answer prefix) is one forward and every later token one of its own.
    """
    total = len(scored)
    if not online:
        return [total]
    lead = next((i for i, s in enumerate(scored) if s), total)
    return ([lead] if lead else []) + [1] * (total - lead)


def compare_runs(
    reference: tuple[list[torch.Tensor], torch.Tensor],
    other: tuple[list[torch.Tensor], torch.Tensor],
    cont: Continuation,
) -> dict[str, Any]:
    ref_out, ref_logp = reference
    out, logp = other
    per_layer = [
        float(torch.linalg.norm(o - r) / torch.linalg.norm(r).clamp_min(1e-30))
        for o, r in zip(out, ref_out, strict=True)
    ]
    targets = torch.tensor(cont.ids, device=logp.device)
    mask = torch.tensor(cont.scored, device=logp.device)
    nll_ref = -ref_logp.gather(-1, targets[:, None])[:, 0][mask]
    nll = -logp.gather(-1, targets[:, None])[:, 0][mask]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)[mask]
    return {
        "rel_error": sum(per_layer) / len(per_layer),
        "nll_delta": float((nll - nll_ref).mean()),
        "kl": float(kl.mean()),
        "nll_full": float(nll_ref.mean()),
        "per_layer": per_layer,
    }


def context_blocks(cache: FoldedCache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer the cached context as ``(keys, values, β)`` of batch row 0, in float64."""
    blocks = []
    for _, layer in cache.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        blocks.append((keys[0].double(), values[0].double(), log_mass[0].double()))
    return blocks


def block_outputs(
    queries: torch.Tensor, block: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scaling: float
) -> torch.Tensor:
    """Attention output of ``queries`` ``(H_q, q, D)`` over one context block alone, ``(H_q, q, D_v)``.

    ``logits = q·k · scaling + β`` over the block's entries (empty slots have β = −inf); the G query
    heads of a GQA group read their KV head.
    """
    keys, values, log_mass = block
    h_q, q_len, d = queries.shape
    h_kv = keys.shape[0]
    grouped = queries.double().reshape(h_kv, (h_q // h_kv) * q_len, d)
    logits = grouped @ keys.mT * scaling + log_mass[:, None, :]
    out = torch.softmax(logits, dim=-1) @ values
    return out.reshape(h_q, q_len, values.shape[-1])


def block_errors(
    queries: list[torch.Tensor],
    full_blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scalings: list[float],
) -> list[float]:
    """Per layer ``‖o_c − o‖ / ‖o‖`` of the context block's attention outputs (see the module docstring)."""
    errors = []
    for q, full, block, scaling in zip(queries, full_blocks, blocks, scalings, strict=True):
        reference = block_outputs(q, full, scaling)
        errors.append(
            float(
                torch.linalg.norm(block_outputs(q, block, scaling) - reference)
                / torch.linalg.norm(reference).clamp_min(1e-30)
            )
        )
    return errors
