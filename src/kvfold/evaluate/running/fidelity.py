"""Fidelity: how close a compressed cache computes to the full one on a held-out continuation.

For each sample a context is prefilled once; a **continuation** is then run, teacher-forced, in one
forward pass (all its tokens at once) over a copy of the full cache and over each compressed
cache, and the two runs are compared (docs/evaluation.md, "Fidelity"):

* ``rel_error`` — per layer ``‖o − o_full‖_F / ‖o_full‖_F`` of the pre-``o_proj`` attention output
  (captured by a forward pre-hook on each attention module's ``o_proj``: its input is the
  ``(B, q, H·D)`` output of the heads) over all the continuation's tokens, averaged over layers
  (``per_layer`` keeps each layer).
* ``nll_delta`` — mean NLL (nats per token) of the scored continuation tokens, compressed minus full.
* ``kl`` — mean KL(full ‖ compressed) of the next-token distributions at the scored tokens.
* ``block_error`` — per layer ``‖o_c − o‖_F / ‖o‖_F`` where ``o`` and ``o_c`` are the attention
  outputs of the *context block alone* (the prefilled cache, before the continuation) over the
  full run's continuation queries, with the full and with the compressed cache (β included).
  The queries are the same in both, so no error propagates from earlier layers: this is the
  numerical error of the compressed cache itself (ZSMerge §4.3, Fig. 4; Attention Matching's
  eq. 1 on held-out queries), averaged over layers (``block_per_layer`` keeps each layer).

Continuations:

* ``"answer"`` (default): the question and answer prefix, as the pipeline appends them (chat
  template when the model has one), followed by the reference answer (all answers joined with
  ``", "`` for ``string_match_all`` tasks, else the first). Only the answer's tokens are scored.
* ``"next"``: the document itself. The context is tokenized, its last ``next_tokens`` tokens are
  held out as the continuation and the rest, decoded back to text, is prefilled without a chat
  template. The first held-out token is predicted by the prefill alone (before any compression),
  so it is not scored; the others are. Samples sharing a context give one continuation.

Offline (default), decode-time policies are switched off (``cache.policy = None``): the continuation
is teacher-forced in one pass, so what is measured is the compressed prefill cache itself.

**Online** (``online=True``, ``kvfold fidelity --online``): the method's decode-time policy runs
while the continuation is teacher-forced, the cache held at its budget the whole way, as during
generation: the unscored lead of the continuation (the question and answer prefix) goes in as one
forward, as :meth:`~kvfold.pipeline.context.CompressedContext.generate` feeds a prompt, and every later
token in a forward of its own, after which the policy evicts (or merges) back to the budget. This
is how ZSMerge measures its error (§4.3). The full-cache reference runs the same schedule, so a
method that compresses nothing gives exactly 0. ``block_error`` is that of the compressed prefill
cache before the continuation, the same in both modes. A method with no online path is not run
offline in its place: its record says ``"online_path": false`` and carries no measures.

Results are written as they are produced (``fidelity_samples.jsonl``, one line per continuation ×
method × budget); a rerun into the same directory with the same configuration measures only what
is missing, and the progress bar shows the time left.

The sweep is cut into :class:`FidelityItem` s, one per context (its continuations, its reference
passes and its compressions), answered here (:func:`fidelity`) or by Ray workers
(:mod:`kvfold.evaluate.running.distributed`, ``kvfold fidelity --ray``) through the same driver
(:meth:`FidelitySweep.run`), with the same rows in the same order. The continuations and the
measures are in :mod:`kvfold.evaluate.running.fidelity_measures`.

Example:
    >>> from kvfold import load_model
    >>> from kvfold.evaluate import fidelity, generate_ruler
    >>> model, tokenizer = load_model()
    >>> samples = generate_ruler(tokenizer, 1024, 1, tasks=["qa_1"])
    >>> result = fidelity(model, tokenizer, samples, ["full", "streamingllm"], [0.5, 0.2])
    >>> [(r["method"], r["budget"], round(r["rel_error"], 3)) for r in result.records]
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.evaluate.data.samples import Sample, group_by_context
from kvfold.evaluate.reporting.fidelity_report import write_fidelity_report
from kvfold.evaluate.running.fidelity_measures import (
    Continuation,
    block_errors,
    compare_runs,
    context_blocks,
    continuations,
    decode_schedule,
)
from kvfold.evaluate.running.sweep import collect_rows, local_runner, open_run, plan_runs, sample_keys, write_json
from kvfold.methods import build_method
from kvfold.methods.core.model import model_name
from kvfold.pipeline.context import PrefilledContext
from kvfold.runtime.attention import attention_modules, attention_scalings
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError

if TYPE_CHECKING:
    from kvfold.evaluate.running.sweep import ItemRunner

__all__ = [
    "FIDELITY_FILE",
    "SAMPLES_FILE",
    "FidelityItem",
    "FidelityResult",
    "FidelitySweep",
    "aggregate_fidelity",
    "fidelity",
    "fidelity_key",
    "fidelity_row_key",
    "measure_item",
    "plan_fidelity_items",
]

FIDELITY_FILE = "fidelity.json"
SAMPLES_FILE = "fidelity_samples.jsonl"
DEFAULT_NEXT_TOKENS = 64


@dataclass
class FidelityResult:
    """What :func:`fidelity` produced.

    Attributes:
        records: one dict per (method, budget): ``rel_error``, ``block_error``, ``nll_delta``,
            ``kl``, ``per_layer`` and ``block_per_layer`` (the two errors per layer), ``kv_ratio``,
            ``n`` (continuations), all means over continuations.
        samples: the same measures per continuation (``sample_id`` included).
        continuation: ``"answer"`` or ``"next"``.
        online: whether decode-time policies ran during the continuation.
        model: the model's name.
        out_dir: where the files were written, or None.
    """

    records: list[dict[str, Any]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    continuation: str = "answer"
    online: bool = False
    model: str = ""
    out_dir: Path | None = None

    def to_json(self) -> dict[str, Any]:
        """The content of ``fidelity.json``."""
        return {"model": self.model, "continuation": self.continuation, "online": self.online, "records": self.records}


def _attention_modules(model: PreTrainedModel) -> list[tuple[int, torch.nn.Module]]:
    """``(layer_idx, module)`` of every attention module in layer order; raises when there is none."""
    modules = attention_modules(model)
    if not modules:
        raise UserError(f"{type(model).__name__}: found no attention modules with `layer_idx` and `o_proj`")
    return list(modules.items())


def _scalings(model: PreTrainedModel) -> list[float]:
    """Each attention module's softmax scaling (``module.scaling``, else ``head_dim**-0.5``)."""
    scalings = attention_scalings(model)
    out = []
    for layer_idx, module in _attention_modules(model):
        scaling = scalings[layer_idx]
        out.append(scaling if scaling is not None else float(module.head_dim) ** -0.5)
    return out


@torch.inference_mode()
def _teacher_forced(
    model: PreTrainedModel,
    cache: FoldedCache,
    cont: Continuation,
    queries: list[torch.Tensor] | None = None,
    *,
    online: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Teacher-force the continuation over ``cache``: pre-o_proj outputs per layer and log-probs.

    Args:
        queries: if given, filled with each layer's continuation queries ``(H_q, q, D)`` (post-RoPE);
            offline only.
        online: keep ``cache.policy`` (the method's decode-time policy, or None) and feed the
            continuation as :func:`decode_schedule` says; offline the policy is switched off and
            the continuation is one forward.

    Returns:
        ``([(q, H·D) per layer], (q, V) log-probabilities of each continuation token's prediction)``.
    """
    captured: dict[int, list[torch.Tensor]] = defaultdict(list)

    def hook(layer_idx: int):
        def capture(module: torch.nn.Module, args: tuple) -> None:
            captured[layer_idx].append(args[0][0].detach().double())

        return capture

    if not online:
        cache.policy = None  # teacher-forced: no decode-time eviction inside the continuation
    if queries is not None:
        if online:
            raise ValueError("continuation queries are captured offline only")
        cache.capture_window = len(cont.ids)
        for _, layer in cache.folded_layers:
            layer.captured_queries = None
    handles = [m.o_proj.register_forward_pre_hook(hook(i)) for i, m in _attention_modules(model)]
    chunks: list[torch.Tensor] = []
    try:
        device = model.device
        done = 0
        for size in decode_schedule(cont.scored, online):
            start = cache.get_seq_length()  # logical: unchanged by eviction
            ids = torch.tensor([cont.ids[done : done + size]], device=device)
            pos = torch.arange(start, start + size, device=device)[None]
            chunks.append(model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[0])
            done += size
    finally:
        for handle in handles:
            handle.remove()
        cache.capture_window = 0
    if queries is not None:
        queries.extend(layer.captured_queries[0] for _, layer in cache.folded_layers)
    logits = torch.cat(chunks, dim=0)
    # token t is predicted by the logits before it: the prefill's last ones for t = 0
    predicting = torch.cat([cont.context.last_logits.to(logits.dtype), logits[:-1]], dim=0)
    outputs = [torch.cat(captured[i], dim=0) for i in sorted(captured)]
    return outputs, torch.log_softmax(predicting.double(), dim=-1)


def fidelity_key(sample_id: str, method: str, budget: float | int) -> tuple[str, str, str]:
    """The key of one fidelity row: continuation id, method spec, budget label (as JSON)."""
    return sample_id, method, json.dumps(budget)


def fidelity_row_key(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """The :func:`fidelity_key` of a row of ``fidelity_samples.jsonl``."""
    return fidelity_key(row["sample_id"], row["method"], row["budget"])


@dataclass(frozen=True)
class FidelityItem:
    """One context's share of a fidelity sweep: its continuations, each measured against every run.

    The context is prefilled once (per prompt format), each continuation's reference passes run
    once, and each (method, budget) compresses the context once for all its continuations.

    Attributes:
        index: position of the item in the sweep (the serial order of its rows).
        samples: the samples of one context (in ``"next"`` mode its first sample only).
        sample_ids: their ids (:func:`~kvfold.evaluate.running.sweep.sample_keys` of the whole sweep).
        runs: ``(method spec, budget)`` pairs with at least one row to produce.
        skip: :func:`fidelity_key` s already measured (earlier runs, or an earlier attempt).
        continuation, next_tokens, online, seed: as for :func:`fidelity`.
    """

    index: int
    samples: tuple[Sample, ...]
    sample_ids: tuple[str, ...]
    runs: tuple[tuple[str, Budget], ...]
    skip: frozenset[tuple[str, str, str]] = frozenset()
    continuation: str = "answer"
    next_tokens: int = DEFAULT_NEXT_TOKENS
    online: bool = False
    seed: int = 0

    @property
    def label(self) -> str:
        """What this item is, for messages."""
        return f"the context of {self.sample_ids[0]}"

    def unit_keys(self) -> list[tuple[str, str, str]]:
        """The keys of the rows this item produces, in the order it produces them."""
        keys = [fidelity_key(sid, spec, b.label()) for sid in self.sample_ids for spec, b in self.runs]
        return [k for k in keys if k not in self.skip]

    row_key = staticmethod(fidelity_row_key)

    def run(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, status: Callable[[str], None] | None = None
    ) -> Iterator[dict[str, Any]]:
        """The item's rows (:func:`measure_item`)."""
        return measure_item(model, tokenizer, self, status)


def plan_fidelity_items(
    samples: Sequence[Sample],
    runs: Sequence[tuple[str, Budget]],
    done: Collection[tuple[str, str, str]] = (),
    *,
    continuation: str = "answer",
    next_tokens: int = DEFAULT_NEXT_TOKENS,
    online: bool = False,
    seed: int = 0,
) -> list[FidelityItem]:
    """Cut a fidelity sweep into one item per context, leaving out rows already in ``done``."""
    key_of = {id(s): k for s, k in zip(samples, sample_keys(samples), strict=True)}
    items: list[FidelityItem] = []
    for _, group in group_by_context(samples):
        chosen = group[:1] if continuation == "next" else group
        ids = tuple(key_of[id(s)] for s in chosen)
        pending = tuple(
            (spec, b) for spec, b in runs if any(fidelity_key(sid, spec, b.label()) not in done for sid in ids)
        )
        if pending:
            skip = frozenset(k for k in done if k[0] in ids)
            items.append(
                FidelityItem(len(items), tuple(chosen), ids, pending, skip, continuation, next_tokens, online, seed)
            )
    return items


def measure_item(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    item: FidelityItem,
    status: Callable[[str], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The rows of one :class:`FidelityItem`, each yielded as soon as it is measured.

    ``status`` hears each (method, budget) before it is measured (progress display).
    """
    built = {spec: build_method(spec) for spec, _ in item.runs}
    finished = {
        sid for sid in item.sample_ids if all(fidelity_key(sid, s, b.label()) in item.skip for s, b in item.runs)
    }
    scalings = _scalings(model)
    online = item.online
    compressed_runs: dict[tuple[str, Budget], Any] = {}
    compressed_for: PrefilledContext | None = None
    for cont in continuations(
        model,
        tokenizer,
        item.samples,
        item.sample_ids,
        item.continuation,
        item.next_tokens,
        list(built.values()),
        finished,
    ):
        queries: list[torch.Tensor] = []
        reference = _teacher_forced(model, cont.context.cache.copy(), cont, queries)
        if online:  # the full cache fed on the same schedule as the compressed ones
            reference = _teacher_forced(model, cont.context.cache.copy(), cont, online=True)
        full_blocks = context_blocks(cont.context.cache)
        if cont.context is not compressed_for:  # questions of one context share its compressions
            compressed_runs, compressed_for = {}, cont.context
        for spec, budget in item.runs:
            if fidelity_key(cont.sample_id, spec, budget.label()) in item.skip:
                continue
            if status is not None:
                status(f"{spec} @ {budget}")
            if (spec, budget) not in compressed_runs:
                compressed_runs[(spec, budget)] = cont.context.compress(built[spec], budget, seed=item.seed)
            compressed = compressed_runs[(spec, budget)]
            row: dict[str, Any] = {
                "sample_id": cont.sample_id,
                "task": cont.task,
                "method": spec,
                "budget": budget.label(),
                "kv_ratio": compressed.kv_bytes / compressed.kv_bytes_full,
                "continuation_tokens": len(cont.ids),
                "scored_tokens": sum(cont.scored),
            }
            if online and compressed.policy is None and not (built[spec].is_identity or budget.is_full):
                row["online_path"] = False  # not run offline in its place
            else:
                cache = compressed.decode_cache() if online else compressed.cache.copy()
                row.update(compare_runs(reference, _teacher_forced(model, cache, cont, online=online), cont))
                block = block_errors(queries, full_blocks, context_blocks(compressed.cache), scalings)
                row.update(block_error=sum(block) / len(block), block_per_layer=block)
                if online:
                    row["online_path"] = compressed.policy is not None
            yield row


def fidelity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    methods: Sequence[str],
    budgets: Sequence[float | int | str | Budget],
    *,
    continuation: Literal["answer", "next"] = "answer",
    next_tokens: int = DEFAULT_NEXT_TOKENS,
    online: bool = False,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    run_config: Mapping[str, Any] | None = None,
) -> FidelityResult:
    """Measure attention-output error and NLL increase of each method × budget against the full cache.

    Args:
        model: a model with the kvfold attention.
        tokenizer: its tokenizer.
        samples: the samples whose contexts (and answers) are used.
        methods: method specs; ``full`` runs once at budget 1.0 (and measures 0 by construction).
        budgets: fractions in (0, 1] or token counts.
        continuation: ``"answer"`` (question + reference answer) or ``"next"`` (held-out document
            tokens); see the module docstring.
        next_tokens: held-out tokens in ``"next"`` mode.
        online: run each method's decode-time policy during the continuation (module docstring);
            a method without one gets a record with ``"online_path": false`` and no measures.
        seed: seed for randomized methods.
        out_dir: where to write ``fidelity.json``, ``fidelity_samples.jsonl``, ``fidelity.md`` and
            ``fidelity.png``; a run found there with the same configuration is resumed.
        progress: show a progress bar (with the time left).
        run_config: what identifies the run for resuming (model, dataset, ...), shown in the report.

    Returns:
        A :class:`FidelityResult`.

    Raises:
        ValueError: an invalid spec, budget or mode, no samples, a context too short to split, or
            ``out_dir`` holding a run with another configuration.
    """
    config = dict(run_config or {"model": model_name(model)})
    sweep = FidelitySweep(samples, methods, budgets, config, continuation, next_tokens, online, seed, out_dir, progress)
    return sweep.run(local_runner(model, tokenizer))


@dataclass(frozen=True)
class FidelitySweep:
    """A fidelity sweep, ready to be measured by any :data:`~kvfold.evaluate.running.sweep.ItemRunner`.

    :func:`fidelity` runs one here; ``run_on_ray(loader, sweep.run)``
    (:func:`kvfold.evaluate.running.distributed.run_on_ray`) on Ray workers.

    Attributes:
        samples, methods, budgets, continuation, next_tokens, online, seed, out_dir, progress: as
            for :func:`fidelity`.
        run_config: what identifies the run (model, dataset, ...); the mode and seed are added.
    """

    samples: Sequence[Sample]
    methods: Sequence[str]
    budgets: Sequence[float | int | str | Budget]
    run_config: Mapping[str, Any]
    continuation: Literal["answer", "next"] = "answer"
    next_tokens: int = DEFAULT_NEXT_TOKENS
    online: bool = False
    seed: int = 0
    out_dir: str | Path | None = None
    progress: bool = True

    def run(self, runner: ItemRunner) -> FidelityResult:
        """Measure the sweep with ``runner`` (serial, or Ray workers).

        The sweep is cut into :class:`FidelityItem` s (rows already in ``out_dir`` left out); each row
        is kept once, appended to ``fidelity_samples.jsonl`` as it arrives and counted by the progress
        bar, and the file ends in the serial order (:func:`~kvfold.evaluate.running.sweep.collect_rows`).

        Raises:
            ValueError: as :func:`fidelity`.
            RuntimeError: the runner ended without producing every row.
            OutputError: ``out_dir`` is in use by another run, or a file cannot be written.
            SweepInterrupted: Ctrl-C (the rows finished before it are kept in ``out_dir``).
        """
        if self.continuation not in ("answer", "next"):
            raise UserError(f"continuation must be 'answer' or 'next'; got {self.continuation!r}")
        if self.next_tokens < 2:
            raise UserError(f"next_tokens must be ≥ 2; got {self.next_tokens}")
        if not self.samples:
            raise UserError("no samples to measure")
        runs = plan_runs(self.methods, self.budgets)
        config = dict(self.run_config)
        config.update(continuation=self.continuation, online=self.online, seed=self.seed)
        if self.continuation == "next":
            config["next_tokens"] = self.next_tokens
        opened = open_run(self.out_dir, config, SAMPLES_FILE, fidelity_row_key, unit="measurement")
        with opened as (out_dir, path, done):
            keys = _continuation_keys(self.samples, self.continuation)
            items = plan_fidelity_items(
                self.samples,
                runs,
                done,
                continuation=self.continuation,
                next_tokens=self.next_tokens,
                online=self.online,
                seed=self.seed,
            )
            total = len(keys) * len(runs)
            progress = {"progress": self.progress, "desc": "fidelity", "unit": "run"}
            collect_rows(runner, items, done, path=path, total=total, **progress)
            rows = [done[fidelity_key(k, spec, b.label())] for spec, b in runs for k in keys]
            result = FidelityResult(
                records=aggregate_fidelity(rows),
                samples=rows,
                continuation=self.continuation,
                online=self.online,
                model=str(config.get("model", "")),
                out_dir=out_dir,
            )
            if result.out_dir is not None:
                write_json(result.out_dir / FIDELITY_FILE, result.to_json())
                write_fidelity_report(result.out_dir, result.records, title_info=config)
        return result


def _continuation_keys(samples: Sequence[Sample], continuation: str) -> list[str]:
    """The sample id of every continuation, in the order :func:`_continuations` yields them."""
    key_of = {id(s): k for s, k in zip(samples, sample_keys(samples), strict=True)}
    keys, seen = [], set()
    for sample in (s for _, group in group_by_context(samples) for s in group):
        if continuation == "next":
            if sample.context in seen:
                continue
            seen.add(sample.context)
        keys.append(key_of[id(sample)])
    return keys


def aggregate_fidelity(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Means over continuations per (method, budget), per-layer errors averaged layer by layer."""
    groups: dict[tuple[str, Any], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["method"], row["budget"])].append(row)
    records = []
    for (method, budget), group in groups.items():
        n = len(group)
        record: dict[str, Any] = {"method": method, "budget": budget}
        if any(r.get("online_path") is False and "rel_error" not in r for r in group):
            record.update(online_path=False, kv_ratio=sum(r["kv_ratio"] for r in group) / n, n=0)
            records.append(record)  # no online path: reported, not measured
            continue
        if "online_path" in group[0]:
            record["online_path"] = all(r["online_path"] for r in group)
        for key in ("rel_error", "block_error", "nll_delta", "kl", "nll_full", "kv_ratio"):
            record[key] = sum(r[key] for r in group) / n
        for key in ("per_layer", "block_per_layer"):
            record[key] = [sum(layer) / n for layer in zip(*(r[key] for r in group), strict=True)]
        record["n"] = n
        records.append(record)
    return records
