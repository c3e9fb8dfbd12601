"""From a user's context to answers through a compressed cache: prefill → compress → answer.

Protocol (docs/evaluation.md): by default **query-agnostic** — the context is prefilled
and compressed alone, then the question (and answer prefix) is appended and decoded greedily.
With ``query_aware=True`` the question is part of what is compressed.

Example:
    >>> from kvfold import load_model, prefill
    >>> model, tokenizer = load_model()
    >>> context = prefill(model, tokenizer, open("report.txt").read())
    >>> small = context.compress()  # kvfold.methods.RECOMMENDED, keeping a tenth of the context
    >>> small.answer("Who signed the report?")
    >>> small.kv_bytes, small.kv_bytes_full
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.methods.core.base import ComposedMethod, build_method, with_format
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.repeat import PLANNED_RECORDS, UNPLANNED
from kvfold.pipeline.memory import (
    MAX_RETRIES,
    cache_dims,
    full_formats,
    full_out_of_reach,
    over_budget,
    plan_memory,
    shrink,
)
from kvfold.pipeline.recompact import repeat_chunks
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.defaults import DEFAULT_BUDGET, RECOMMENDED
from kvfold.runtime.errors import UserError
from kvfold.runtime.prompts import PromptParts, build_prompt, encode  # noqa: F401 - PromptParts: re-exported
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.timing import device_clock

DEFAULT_SNAPSHOT_WINDOW = 64
"""Prefill query states kept per layer for methods with an observation window (SnapKV: 32)."""
REPEAT_PROMPT_ALLOWANCE = 256
"""Tokens of a repeat chunk's prompt (instruction, the previous chunk's last tokens, template) that
the spare capacity of a prefill for a repeat-pass method allows beyond the chunk."""


def _max_positions(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None)


def check_length(model: PreTrainedModel, total_tokens: int) -> None:
    """Raise a clear error when a prompt would not fit the model's positions."""
    limit = _max_positions(model)
    if limit is not None and total_tokens > limit:
        raise UserError(
            f"context, question and answer need {total_tokens} tokens but the model supports {limit} positions; "
            "shorten the context or ask for fewer new tokens"
        )


@dataclass
class PrefilledContext:
    """A context prefilled once into a full :class:`FoldedCache`; compress copies of it.

    Attributes:
        model, tokenizer: what produced it.
        cache: the full cache (not modified by :meth:`compress`).
        input_ids: ``(B, N)`` context tokens (left-padded for batches).
        attention_mask: ``(B, N)``.
        question: set in query-aware mode (the question is inside the context).
        prefill_seconds: wall time of the prefill.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    cache: FoldedCache
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prefill_seconds: float
    suffixes: list[str] | None = None
    last_logits: torch.Tensor | None = None
    shared: dict[Any, Any] = field(default_factory=dict, repr=False)
    """Budget-independent results kept across compressions (``CompressionContext.shared``)."""

    @property
    def context_tokens(self) -> int:
        return int(self.attention_mask.sum(-1).max())

    def compression_context(self, cache: FoldedCache, budget: Budget, **options: Any) -> CompressionContext:
        """What a method needs to compress ``cache`` (this context's, or a copy of it) to ``budget``.

        Args:
            cache: the cache the method compresses in place.
            budget: the budget.
            **options: more :class:`~kvfold.methods.core.base.CompressionContext` fields (``seed``,
                ``shared`` = ``self.shared`` to reuse results across compressions, ``merge_recorder``).
        """
        return CompressionContext(
            model=self.model,
            cache=cache,
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            budget=budget,
            tokenizer=self.tokenizer,
            **options,
        )

    def compress(
        self,
        method: str | ComposedMethod = RECOMMENDED,
        budget: float | int | str | Budget | None = None,
        *,
        memory: float | None = None,
        kv_format: str | int | None = None,
        seed: int = 0,
    ) -> CompressedContext:
        """Compress a copy of the prefilled cache with a method spec and a token or memory budget.

        Args:
            method: a method spec (``"snapkv"``, ``"adakv:snapkv+grkv"``, ``"kvzip@int4"``, …) or a
                built method; by default :data:`kvfold.methods.RECOMMENDED`. ``"full"`` keeps everything.
            budget: a fraction in (0, 1] of the context to keep, or a token count (default
                :data:`kvfold.runtime.defaults.DEFAULT_BUDGET`, a tenth, when neither this nor ``memory``
                is given).
            memory: instead of ``budget``, the fraction in (0, 1] of the 16-bit full cache's bytes the
                compressed cache may hold: the library chooses the tokens and the precision
                (:mod:`kvfold.pipeline.memory`), unless the spec or ``kv_format`` names the precision.
            kv_format: the storage of the compressed entries (``"int4"``, ``4``, ``"fp8"``,
                ``"16"`` for the model's dtype), when the spec names none.
            seed: seed for randomized methods.

        Returns:
            A :class:`CompressedContext` that answers questions; this object is unchanged.

        Raises:
            UserError: both ``budget`` and ``memory``, or an invalid one.
        """
        composed = build_method(with_format(method, kv_format)) if isinstance(method, str) else method
        if memory is not None or (isinstance(budget, Budget) and budget.memory is not None):
            if memory is not None and budget is not None:
                raise UserError("give a token budget or a memory budget, not both")
            target = Budget.of_memory(memory) if memory is not None else budget
            return self._compress_to_memory(composed, target, seed)
        parsed_budget = Budget.parse(DEFAULT_BUDGET if budget is None else budget)
        return self._compress(composed, parsed_budget, seed)

    def _compress(self, composed: ComposedMethod, budget: Budget, seed: int) -> CompressedContext:
        cache = self.cache.copy()
        ctx = self.compression_context(cache, budget, seed=seed, shared=self.shared)
        start = device_clock(self.model.device)
        policy = composed.apply(ctx)
        # the time this compression costs alone: shared results it reused count as if computed here
        elapsed = device_clock(self.model.device) - start + ctx.report.get("reused_seconds", 0.0)
        return CompressedContext(self, composed, budget, cache, policy, elapsed, ctx.report)

    def _compress_to_memory(self, composed: ComposedMethod, target: Budget, seed: int) -> CompressedContext:
        """Compress within ``target.memory`` of the 16-bit full cache's bytes: the planned tokens and
        precision, redone smaller while the result holds more (at most :data:`MAX_RETRIES` times); its
        ``compress_seconds`` are every attempt's (shared results counted once, :func:`own_seconds`),
        ``report["compressions"]`` their number.
        ``full`` keeps every token in the widest storage that holds within the budget
        (:meth:`_full_to_memory`).

        Raises:
            UserError: no compression within the budget (a context too short for it, or ``full`` at a
                memory no storage of every token reaches).
        """
        if composed.is_identity:
            return self._full_to_memory(composed, target, seed)
        plan = plan_memory(target.memory, composed, self.cache, self.context_tokens)
        stored = _stored_as(composed, plan.quant)
        result = self._compress(stored, plan.tokens, seed)
        spent = result.compress_seconds  # every attempt is the user's time
        previous = None  # (token fraction, memory held) of the attempt before
        for attempt in range(MAX_RETRIES + 1):
            measured = over_budget(result.cache, target.memory)
            if measured is None:
                break
            if attempt == MAX_RETRIES or plan.tokens.count(self.context_tokens) <= 1:
                raise UserError(
                    f"memory {target.memory:g} is too small for this context of {self.context_tokens} tokens: "
                    f"after {attempt + 1} compressions {stored.spec} still holds {measured:.4g} of the 16-bit "
                    "full cache; give a larger memory budget"
                )
            smaller = shrink(plan, measured, self.context_tokens, previous)
            previous = (plan.tokens.fraction, measured)
            plan = smaller
            result = self._compress(stored, plan.tokens, seed)
            spent += own_seconds(result)
        result.compress_seconds = spent
        result.report["compressions"] = attempt + 1
        result.memory = target.memory
        result.token_budget = plan.tokens
        return result

    def _full_to_memory(self, composed: ComposedMethod, target: Budget, seed: int) -> CompressedContext:
        """``full`` within ``target.memory``: every token, in the widest storage whose bytes hold within
        the budget (:func:`~kvfold.pipeline.memory.full_formats`, each checked on the bytes it holds).

        Raises:
            UserError: no storage of every token holds within the budget (what ``full`` can reach and
                the advice to use a method that keeps fewer tokens).
        """
        head_dim, value_dim = cache_dims(self.cache)
        held = None
        spent = 0.0
        for tried, quant in enumerate(full_formats(target.memory, composed, head_dim, value_dim), start=1):
            result = self._compress(_stored_as(composed, quant), Budget(fraction=1.0), seed)
            spent += own_seconds(result) if tried > 1 else result.compress_seconds
            result.compress_seconds = spent
            held = over_budget(result.cache, target.memory)
            if held is None:
                result.report["compressions"] = tried
                result.memory = target.memory
                result.token_budget = Budget(fraction=1.0)
                return result
        raise full_out_of_reach(target.memory, composed, head_dim, value_dim, held)


def own_seconds(result: CompressedContext) -> float:
    """A retry's own time: its compression's, less what it reused of shared results (the first
    attempt counted them as if computed, :meth:`PrefilledContext._compress`)."""
    return result.compress_seconds - result.report.get("reused_seconds", 0.0)


def _stored_as(composed: ComposedMethod, quant: QuantConfig | None) -> ComposedMethod:
    """The method stored in ``quant``; a spec that named no storage gets it appended (``kvzip@int4``)."""
    stored = dataclasses.replace(composed, quant=quant, precision_fixed=True)
    if not composed.precision_fixed:
        suffix = "@16" if quant is None else f"@{quant.describe()}"
        stored = dataclasses.replace(stored, spec=composed.spec + suffix)
    return stored


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    new_tokens: int
    decode_seconds: float


@dataclass
class CompressedContext:
    """A compressed cache ready to answer questions (each answer works on a copy)."""

    source: PrefilledContext
    method: ComposedMethod
    budget: Budget
    cache: FoldedCache
    policy: Any
    compress_seconds: float
    report: dict[str, Any] = field(default_factory=dict)
    memory: float | None = None
    """The memory budget asked for (a fraction of the 16-bit full cache's bytes), or None."""
    token_budget: Budget | None = None
    """With a memory budget: the token budget it was spent on."""

    @property
    def kv_bytes(self) -> int:
        """Bytes the compressed cache holds: codes, scales, zero points, β, keys and values (counted
        before any question is appended; spare capacity and page rounding apart, :attr:`kv_bytes_reserved`)."""
        return self.cache.content_nbytes()

    @property
    def kv_bytes_reserved(self) -> int:
        """Bytes held beyond :attr:`kv_bytes`: capacity kept free for appending and page rounding."""
        return self.cache.nbytes() - self.cache.content_nbytes()

    @property
    def kv_bytes_full(self) -> int:
        """Bytes the uncompressed cache of this context holds (keys and values, the model's dtype)."""
        return self.cache.full_nbytes()

    @property
    def memory_ratio(self) -> float:
        """The cache's bytes over the full cache's, both counted at 16 bits for unquantized
        elements, as a GPU user holds them (:meth:`FoldedCache.memory_ratio`)."""
        return self.cache.memory_ratio()

    def memory_record(self) -> dict[str, Any]:
        """The fields every result record carries about memory: ``kv_bytes``, ``kv_bytes_full``,
        ``kv_bytes_16`` (the cache at 16 bits), ``kv_bytes_full_16``, ``memory`` (the budget asked
        for, or None), ``memory_ratio``, ``kv_format``, with a memory budget ``token_budget``, and
        ``compressions`` (1, or more when a memory budget redid it smaller)."""
        quant = self.cache.quant
        return {
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "kv_bytes_16": self.cache.content_nbytes(sixteen_bit=True),
            "kv_bytes_full_16": self.cache.full_nbytes(sixteen_bit=True),
            "memory": self.memory,
            "memory_ratio": self.memory_ratio,
            "kv_format": "16" if quant is None else quant.describe(),
            "token_budget": None if self.token_budget is None else self.token_budget.label(),
            "compressions": int(self.report.get("compressions", 1)),
        }

    def answer(self, question: str = "", **options: Any) -> str | list[str]:
        """Append the question to a copy of the compressed cache and decode greedily.

        In query-aware mode the question was given to :func:`prefill` and must not be repeated.

        Args:
            question: the question.
            **options: ``answer_prefix``, ``max_new_tokens`` (32) and ``use_chat_template``, as
                :meth:`generate` takes them.

        Returns:
            The answer text (a list for a batch of contexts).
        """
        answers = self.generate(question, **options)
        texts = [a.text for a in answers]
        return texts[0] if len(texts) == 1 else texts

    def decode_cache(self, row: int = 0) -> FoldedCache:
        """A copy of one batch row of the compressed cache, ready to decode from.

        The copy carries a fresh decode-time policy of the method (``cache.policy``) when the method
        has an online path, so it stays at its budget while tokens are appended, exactly as during
        :meth:`generate`; the policy's state follows this copy only.
        """
        cache = _row_cache(self.cache, row, self.source.input_ids.shape[0])
        if self.policy is not None:
            cache.policy = self.method.online_policy(_row_context(self, cache, row))
        return cache

    def generate(
        self,
        question: str = "",
        *,
        answer_prefix: str = "",
        max_new_tokens: int = 32,
        use_chat_template: bool | None = None,
    ) -> list[Answer]:
        """Like :meth:`answer` but returns token ids and timings per batch row."""
        src = self.source
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be ≥ 1; got {max_new_tokens}")
        if src.suffixes is not None:
            if question:
                raise UserError("this context was prefilled query-aware; its question is already inside it")
            suffixes = [s + answer_prefix for s in src.suffixes]
        else:
            tok = src.tokenizer
            parts = build_prompt(tok, "", question, answer_prefix, use_chat_template=use_chat_template)
            suffixes = [parts.suffix] * src.input_ids.shape[0]
        results = []
        for row, suffix in enumerate(suffixes):
            cache = self.decode_cache(row)
            suffix_ids = encode(src.tokenizer, suffix, special=False) if suffix else []
            check_length(src.model, src.input_ids.shape[1] + len(suffix_ids) + max_new_tokens)
            start_pos = int(src.attention_mask[row].sum())
            pad = src.input_ids.shape[1] - start_pos
            first_logits = None if suffix_ids else src.last_logits[row : row + 1]
            results.append(
                greedy_decode(
                    src.model,
                    src.tokenizer,
                    cache,
                    suffix_ids,
                    max_new_tokens,
                    position_offset=-pad,
                    first_logits=first_logits,
                )
            )
        return results


def _row_cache(cache: FoldedCache, row: int, batch: int) -> FoldedCache:
    copy = cache.copy()
    if batch > 1:
        copy.batch_select_indices(torch.tensor([row]))
    return copy


def _row_context(compressed: CompressedContext, cache: FoldedCache, row: int) -> CompressionContext:
    src = compressed.source
    return CompressionContext(
        model=src.model,
        cache=cache,
        input_ids=src.input_ids[row : row + 1],
        attention_mask=src.attention_mask[row : row + 1],
        budget=compressed.budget,
        tokenizer=src.tokenizer,
    )


@torch.inference_mode()
def greedy_decode(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cache: FoldedCache,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    position_offset: int = 0,
    first_logits: torch.Tensor | None = None,
    stop_at_eos: bool = True,
) -> Answer:
    """Feed ``prompt_ids`` after the cache, then decode greedily (batch of one).

    Positions continue from the cache's logical length (plus ``position_offset``, minus the
    left padding of the row), exactly as without compression.
    """
    device = model.device
    eos = eos_ids(model, tokenizer)
    logical = cache.get_seq_length()
    generated: list[int] = []
    start = device_clock(device)
    if prompt_ids:
        ids = torch.tensor([prompt_ids], device=device)
        pos = torch.arange(logical, logical + len(prompt_ids), device=device)[None] + position_offset
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
    else:
        if first_logits is None:
            raise ValueError("nothing to decode from: give prompt ids or the last prefill logits")
        logits = first_logits
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1)[0])
        if stop_at_eos and token in eos:
            break
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        logical = cache.get_seq_length()
        ids = torch.tensor([[token]], device=device)
        pos = torch.tensor([[logical + position_offset]], device=device)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
    elapsed = device_clock(device) - start
    text = tokenizer.decode(generated, skip_special_tokens=True)
    return Answer(text=text, token_ids=generated, new_tokens=len(generated), decode_seconds=elapsed)


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Token ids that end an answer: the generation config's, the config's and the tokenizer's EOS,
    and ChatML's ``<|im_end|>`` when the vocabulary has it."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
        ids.add(im_end)
    return ids


def _planned_methods(
    methods: str | ComposedMethod | Sequence[str | ComposedMethod] | None,
) -> list[ComposedMethod]:
    """Build the methods announced to :func:`prefill` (specs or built methods)."""
    from kvfold.methods.core.spec import split_specs

    if methods is None:
        return []
    items = [methods] if isinstance(methods, (str, ComposedMethod)) else list(methods)
    built: list[ComposedMethod] = []
    for item in items:
        specs = split_specs(item) if isinstance(item, str) else [item]
        built.extend(build_method(s) if isinstance(s, str) else s for s in specs)
    return built


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str | list[str],
    *,
    question: str | list[str] | None = None,
    query_aware: bool = False,
    answer_prefix: str = "",
    use_chat_template: bool | None = None,
    capture_window: int = DEFAULT_SNAPSHOT_WINDOW,
    methods: str | ComposedMethod | Sequence[str | ComposedMethod] | None = None,
) -> PrefilledContext:
    """Tokenize and prefill one context (or a left-padded batch of contexts) into a FoldedCache.

    Args:
        model: a model prepared by :func:`kvfold.load_model` or :func:`kvfold.prepare_model`.
        tokenizer: its tokenizer.
        context: the text to compress (or a list for a batch).
        question: with ``query_aware=True``, the question compressed together with the context.
        query_aware: put the question inside the compressed part.
        answer_prefix: query-aware only: appended after the question.
        capture_window: last prefill query states kept per layer for windowed methods.
        methods: the method specs this context will be compressed with (a spec, a list of
            specs, or a comma-separated list). The prefill then captures what they need: a
            longer query window if one asks for more than ``capture_window``, and statistics
            computed during the prefill itself (H2O's accumulated attention), and the repeat
            pass records what they all read (KVzip's scores, Attention Matching's queries) in
            one pass, and nothing more. Methods not listed still work; H2O then recomputes its
            statistics with an extra forward pass, and a repeat-pass method may run a pass of its own.

    Raises:
        ValueError: empty context, or a context beyond the model's positions.
    """
    contexts = [context] if isinstance(context, str) else list(context)
    if not contexts or any(not c or not c.strip() for c in contexts):
        raise UserError("the context is empty; give a text to compress")
    questions = [question] * len(contexts) if isinstance(question, str) or question is None else list(question)
    if query_aware and any(not q for q in questions):
        raise UserError("query-aware mode needs the question at prefill time")
    rows, suffixes = [], []
    for text, q in zip(contexts, questions, strict=True):
        if query_aware:
            parts = build_prompt(tokenizer, text, q, answer_prefix, use_chat_template=use_chat_template)
            rows.append(encode(tokenizer, parts.context + parts.suffix, special=True))
            suffixes.append("")
        else:
            parts = build_prompt(tokenizer, text, "", use_chat_template=use_chat_template)
            rows.append(encode(tokenizer, parts.context, special=True))
    longest = max(len(r) for r in rows)
    check_length(model, longest + 1)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad_id] * (longest - len(r)) + r for r in rows], device=model.device)
    attention_mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows], device=model.device)
    return prefill_ids(
        model,
        tokenizer,
        input_ids,
        attention_mask if len(rows) > 1 else None,
        capture_window=capture_window,
        methods=methods,
        suffixes=suffixes if query_aware else None,
    )


@torch.inference_mode()
def prefill_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    capture_window: int = DEFAULT_SNAPSHOT_WINDOW,
    methods: str | ComposedMethod | Sequence[str | ComposedMethod] | None = None,
    suffixes: list[str] | None = None,
) -> PrefilledContext:
    """Prefill token ids already encoded (``(B, N)``, left-padded) into a full :class:`FoldedCache`.

    Args:
        attention_mask: ``(B, N)`` with 0 on left padding; None when no row is padded (the model
            then runs without a mask).
        capture_window, methods: as in :func:`prefill`.
        suffixes: the query-aware suffixes, kept on the returned context.
    """
    cache = FoldedCache(model.config)
    planned = _planned_methods(methods)
    cache.capture_window = max([capture_window, *(m.query_window for m in planned)])
    repeating = [size for m in planned if m.uses_repeat_pass for size in repeat_chunks(m)]
    if repeating:  # the repeat pass appends a chunk and its prompt over the cache: room for it now
        cache.set_spare_capacity(max(repeating) + REPEAT_PROMPT_ALLOWANCE)
    cache.prefill_observers = list({o.key: o for m in planned for o in m.prefill_observers()}.values())
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    start = device_clock(model.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    elapsed = device_clock(model.device) - start
    cache.capture_window = 0
    cache.prefill_observers = []
    last_logits = out.logits[:, -1]
    prefilled = PrefilledContext(model, tokenizer, cache, input_ids, mask, elapsed, suffixes, last_logits)
    # what the methods to come read from the repeat pass (its first run records all of it): the announced
    # methods' needs, else KVzip's scores and the queries (most methods compressed later reuse them)
    ctx = prefilled.compression_context(cache, Budget.parse(1.0)) if planned else None  # what they read here
    records = frozenset().union(*(m.repeat_records(ctx) for m in planned)) if planned else UNPLANNED
    prefilled.shared[PLANNED_RECORDS] = (records, 0.0)
    return prefilled
