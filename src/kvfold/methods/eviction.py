"""The eviction baselines as registered, composable methods (issue 4).

Scorers are :class:`~kvfold.methods.base.Selector` subclasses: they only say how important each
entry is (with the pure functions of :mod:`kvfold.methods.scoring`) and which entries are
protected; the shared :class:`~kvfold.methods.base.ComposedMethod` keeps the top ones and edits
the cache. Budgets come from :mod:`kvfold.methods.budgets`. Wrappers (``adakv:``,
``criticalkv:``) take any scorer::

    snapkv  pyramidkv  h2o  tova  knorm  kvzip  expected_attention
    adakv:snapkv  criticalkv:snapkv  adakv:criticalkv:snapkv  adakv:kvzip  …

Query-agnostic protocol (the default of :func:`kvfold.prefill`): the context is compressed
without the question, so windows of "last queries" (SnapKV, PyramidKV, TOVA, Expected
Attention) are the last tokens of the context, not the question.

``h2o``, ``tova`` and ``knorm`` (like ``streamingllm``) also run online: during decoding the
cache never holds more than the budget per row (:class:`~kvfold.methods.online.OnlineEviction`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from kvfold.cache import FoldedCache, FoldedLayer
from kvfold.methods.base import CompressionContext, Selector, Wrapper, register
from kvfold.methods.budgets import adakv_head_budgets, pyramid_layer_budgets
from kvfold.methods.online import PROTECTED, OnlineEviction
from kvfold.methods.scoring import (
    critical_reweight,
    critical_two_stage_select,
    expected_attention_scores,
    h2o_scores,
    knorm_scores,
    pool_gqa,
    protected_mask,
    snapkv_scores,
    topk_keep,
    tova_scores,
    window_attention,
)
from kvfold.methods.spec import SpecError
from kvfold.prompts import encode, template_parts

Tensor = torch.Tensor

# ---------------------------------------------------------------------------- shared helpers


def attention_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """The attention module of every decoder layer by layer index (modules with ``layer_idx`` and
    ``o_proj``: the same rule :func:`kvfold.enable` uses to find them)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            found.setdefault(int(module.layer_idx), module)
    return found


def _attention_module(ctx: CompressionContext, layer_idx: int) -> torch.nn.Module:
    modules = ctx.memo.get("attention_modules")
    if modules is None:
        modules = ctx.memo["attention_modules"] = attention_modules(ctx.model)
    if layer_idx not in modules:
        raise ValueError(
            f"found no attention module for layer {layer_idx} in {type(ctx.model).__name__} "
            "(expected modules with `layer_idx` and `o_proj`, as in Llama, Mistral, Qwen and Gemma3)"
        )
    return modules[layer_idx]


def _scaling(ctx: CompressionContext, layer_idx: int, layer: FoldedLayer) -> float:
    """The layer's logit scale (``module.scaling``; ``1/√D`` when the module has none)."""
    return float(getattr(_attention_module(ctx, layer_idx), "scaling", layer.head_dim**-0.5))


def o_proj_weight(ctx: CompressionContext, layer_idx: int) -> Tensor:
    """``W_o`` ``(hidden, H_q·D)`` of a layer's attention (CriticalKV's output projection)."""
    module = _attention_module(ctx, layer_idx)
    weight = getattr(module.o_proj, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"layer {layer_idx}: o_proj has no 2-D weight (quantized modules are not supported)")
    return weight


def _content(layer: FoldedLayer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keys, values, finite β (0 on empty slots) and the validity mask of a layer."""
    keys, values, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
    return keys, values, beta, valid


def _window_queries(layer: FoldedLayer, width: int, method: str, strict: bool = True) -> Tensor:
    """The last ``width`` prefill queries ``(B, H_q, W, D)``.

    Their tokens are the layer's last ``W`` slots: true after a prefill, after appending a chunk
    to a compressed cache (chunked prefill), and after any selection that keeps its window (kept
    entries stay in position order).
    """
    captured = layer.captured_queries
    if captured is None:
        raise ValueError(
            f"{method} reads the last prefill query states, but this cache kept none; prefill with "
            "kvfold.prefill (or set cache.capture_window before the forward pass)"
        )
    needed = min(width, layer.physical_length)
    if strict and captured.shape[2] < needed:
        raise ValueError(
            f"{method} needs the last {needed} prefill queries but the prefill kept {captured.shape[2]}; "
            f"pass methods=[...] or capture_window={width} to kvfold.prefill"
        )
    return captured[:, :, -needed:]


def _last_valid(valid: Tensor, counts: Tensor) -> Tensor:
    """``(B, H, N)`` bool: the last ``counts[b]`` valid entries of each row (``counts`` ``(B,)``)."""
    from_end = valid.long().flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid entry
    return valid & (from_end <= counts.to(valid.device)[:, None, None])


def _first_valid(valid: Tensor, count: int) -> Tensor:
    return protected_mask(*valid.shape, sinks=count, valid=valid)


def _online_limits(selector: Selector, ctx: CompressionContext) -> dict[int, int]:
    """Per-layer online limits: the counts used at compression (max over batch rows)."""
    budgets = selector.layer_budgets(ctx)
    return {i: int(budgets[i].max()) for i, _ in ctx.cache.folded_layers}


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotary_embedding(model: PreTrainedModel) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module (needed to undo RoPE)")
    return rotary


def rope_tables(model: PreTrainedModel, layer_idx: int, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The model's own RoPE ``cos``, ``sin`` ``(T, D)`` float32 at ``positions`` for one layer."""
    rotary = _rotary_embedding(model)
    kwargs: dict[str, Any] = {}
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma3: per layer type
        types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        kwargs["layer_type"] = types[layer_idx] if types else "full_attention"
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    cos, sin = rotary(probe, positions[None].long(), **kwargs)
    return cos[0].float(), sin[0].float()


def unrotate(queries: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Undo RoPE: ``R_t⁻¹ y = (cos·y − sin·rotate_half(y)) / (cos² + sin²)``.

    RoPE is a rotation (times transformers' ``attention_scaling`` a, folded into cos and sin),
    so its inverse is the rotation by −θ divided by a²; ``cos² + sin² = a²`` elementwise.

    Args:
        queries: ``(..., T, D)`` post-RoPE states at the positions of ``cos``/``sin`` ``(T, D)``.
    """
    dtype = torch.promote_types(queries.dtype, torch.float32)
    y = queries.to(dtype)
    cos, sin = cos.to(dtype), sin.to(dtype)
    return (y * cos - _rotate_half(y) * sin) / (cos * cos + sin * sin)


# ---------------------------------------------------------------------------- SnapKV, PyramidKV


@register
@dataclass
class SnapKV(Selector):
    """SnapKV (Li et al. 2024, arXiv:2404.14469, §4 and Algorithm 1).

    Each entry's score is the attention it receives from the last ``window`` prompt queries (the
    observation window), pooled along tokens (``kernel``, ``pooling``), averaged over a GQA group;
    the top entries plus the window itself are kept. In the query-agnostic protocol the window is
    the end of the context, not the question (so it may miss what a later question needs).

    Parameters:
        window: observation window (32 in the paper).
        kernel: pooling kernel, odd (SnapKV uses 5 or 7; 1 = no pooling).
        pooling: ``max`` (the paper's clustering) or ``avg``.
    """

    name: ClassVar[str] = "snapkv"
    description: ClassVar[str] = "attention of the last 32 context queries, max-pooled; keeps the window"
    paper: ClassVar[str] = "Li et al. 2024, SnapKV: LLM Knows What You Are Looking for Before Generation"
    supports_chunked_prefill: ClassVar[bool] = True  # the window of the newest chunk scores the rest
    window: int = 32
    kernel: int = 5
    pooling: str = "max"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        if self.window < 1:
            raise SpecError(f"{self.name}: window must be ≥ 1; got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise SpecError(f"{self.name}: kernel must be an odd positive integer; got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise SpecError(f"{self.name}: pooling must be 'max' or 'avg'; got {self.pooling!r}")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, beta, valid = _content(layer)
        queries = _window_queries(layer, self.window, self.name)
        scaling = _scaling(ctx, layer_idx, layer)
        return snapkv_scores(
            queries, keys, scaling, self.window, self.kernel, self.pooling, log_mass=beta, valid=valid
        )

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=self.window, valid=valid)


@register
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069, §3): SnapKV scores with budgets that decrease
    with depth (an arithmetic sequence; the top layer gets ``1/β`` of the average outside the
    window, see :func:`kvfold.methods.budgets.pyramid_layer_budgets`).

    Budgets are computed per batch row (rows may hold contexts of different lengths); the mean
    over layers equals the requested budget.

    Parameters:
        window, kernel, pooling: as SnapKV.
        beta: ``β`` of the pyramid (20 in the paper).
    """

    name: ClassVar[str] = "pyramidkv"
    description: ClassVar[str] = "SnapKV scores, layer budgets decreasing with depth (pyramid, beta=20)"
    paper: ClassVar[str] = (
        "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    )
    supports_chunked_prefill: ClassVar[bool] = False  # layer 0 holds more than the budget
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise SpecError(f"{self.name}: beta must be > 0; got {self.beta}")

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        folded = [i for i, _ in ctx.cache.folded_layers]
        budgets = [ctx.row_budgets.clone() for _ in range(ctx.num_layers)]
        rows = zip(ctx.row_budgets.tolist(), ctx.context_lengths.tolist(), strict=True)
        per_row = [  # one schedule per batch row, (L_folded,) each
            pyramid_layer_budgets(avg, len(folded), self.beta, self.window, context_tokens=n) for avg, n in rows
        ]
        table = torch.tensor(per_row, dtype=torch.long).T  # (L_folded, B)
        for j, layer_idx in enumerate(folded):
            budgets[layer_idx] = table[j].clone()
        return budgets


# ---------------------------------------------------------------------------- H2O


class H2OPrefillObserver:
    """Accumulates H2O's attention during the prefill (attention calls it once per layer).

    Writes ``layer.entry_stats["h2o"]`` ``(B, H_kv, N)``: the attention each entry received from
    all prefill queries, summed over the GQA group (:func:`kvfold.methods.scoring.h2o_scores`,
    computed ``chunk`` queries at a time so at most ``(B, H_q, chunk, N)`` probabilities exist).
    """

    key = "h2o"

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk

    def __call__(self, layer_idx: int, layer: FoldedLayer, query: Tensor, scaling: float) -> None:
        keys, _, beta, valid = _content(layer)
        layer.entry_stats[self.key] = h2o_scores(
            query, keys, scaling, chunk=self.chunk, gqa_reduce="sum", log_mass=beta, valid=valid
        )


def observe_prefill(ctx: CompressionContext, observers: list) -> None:
    """Re-run the prefill of ``ctx.input_ids`` with prefill observers and copy their statistics
    into ``ctx.cache`` (for a context prefilled without them). Costs one extra forward pass."""
    model = ctx.model
    if model.config._attn_implementation != "kvfold":
        raise ValueError("prefill statistics need the kvfold attention: call kvfold.enable(model) first")
    ids, mask = ctx.input_ids, ctx.attention_mask
    if mask is None:
        mask = torch.ones_like(ids)
    scratch = FoldedCache(model.config)
    scratch.prefill_observers = list(observers)
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=mask if ids.shape[0] > 1 else None,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=scratch,
            use_cache=True,
            logits_to_keep=1,
        )
    for layer_idx, layer in ctx.cache.folded_layers:
        for observer in observers:
            layer.entry_stats[observer.key] = scratch.layers[layer_idx].entry_stats[observer.key]


class H2OOnline(OnlineEviction):
    """Online H2O: each step adds the step's attention to every entry's accumulated score
    (:func:`kvfold.methods.scoring.h2o_update`); the ``recent`` newest tokens and the sinks are
    never evicted; otherwise the entry with the least accumulated attention goes."""

    def __init__(self, limits: dict[int, int], recent: int, sinks: int) -> None:
        super().__init__(limits, needs_attention=True, recent=recent)
        self.sinks = sinks

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        stats = layer.entry_stats.get(H2OPrefillObserver.key)
        if stats is None or stats.shape[-1] != count:
            raise ValueError(
                "online h2o continues the accumulated attention of the kept entries; compress this cache "
                "with h2o first (its statistics are missing or no longer match the cache)"
            )
        _, _, log_mass = layer.dense_buffers()
        sinks = _first_valid(torch.isfinite(log_mass[:, :, :count]), self.sinks)
        return stats.float().masked_fill(sinks, PROTECTED)

    def export_scores(self, layer_idx: int, layer: FoldedLayer, scores: Tensor) -> None:
        layer.entry_stats[H2OPrefillObserver.key] = scores  # the accumulated attention (sinks: +inf)

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        if probs is None:
            return state.new_zeros(state.shape[0], state.shape[1], q_len)
        # h2o_update in place: Σ over every query seen of its attention (new entries start from 0)
        old = state.shape[-1]
        if probs.shape[-1] < old:
            raise ValueError(f"accumulator has {old} entries but the step attends {probs.shape[-1]}")
        step = probs[:, :, 0] if q_len == 1 else probs.sum(dim=2)
        added = pool_gqa(step, state.shape[1], "sum")
        state.add_(added[..., :old])  # computed in the promoted dtype, rounded to the state's
        return added[..., old:]


@register
@dataclass
class H2O(Selector):
    """H2O, Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048, the H₂ eviction policy, Algorithm 1).

    Score = attention accumulated over every prefill query (computed during the prefill by
    :class:`H2OPrefillObserver`, or by an extra forward pass when the prefill ran without it).
    The budget is split between heavy hitters and the most recent tokens, half and half as in
    the paper's experiments. Online (default): during decoding the scores keep accumulating and
    the cache never exceeds the budget. Chunked prefill runs the online policy over the chunks
    after the first (:mod:`kvfold.chunked`): an entry's score is the attention it received from
    every query seen, chunk after chunk, on the evolving cache (the H₂ policy of Algorithm 1,
    ``chunk`` queries per step).

    Parameters:
        recent_ratio: share of the budget kept for the most recent tokens (0.5: the paper's
            equal heavy/recent split).
        sinks: first tokens always kept (0: H2O keeps none).
        online: keep the budget during decoding too.
    """

    name: ClassVar[str] = "h2o"
    description: ClassVar[str] = "heavy hitters by accumulated attention + recent half; online during decoding"
    paper: ClassVar[str] = (
        "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
    )
    supports_chunked_prefill: ClassVar[bool] = True
    chunked_prefill_online: ClassVar[bool] = True  # the scores need every chunk's attention
    recent_ratio: float = 0.5
    sinks: int = 0
    online: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise SpecError(f"h2o: recent_ratio must be in [0, 1]; got {self.recent_ratio}")
        if self.sinks < 0:
            raise SpecError(f"h2o: sinks must be ≥ 0; got {self.sinks}")

    def prefill_observers(self) -> list:
        return [H2OPrefillObserver()]

    def prepare(self, ctx: CompressionContext) -> None:
        def ready(layer: FoldedLayer) -> bool:
            stats = layer.entry_stats.get(H2OPrefillObserver.key)
            return stats is not None and stats.shape == (layer.batch_size, layer.num_heads, layer.physical_length)

        if not all(ready(layer) for _, layer in ctx.cache.folded_layers):
            observe_prefill(ctx, [H2OPrefillObserver()])
            ctx.report["h2o"] = (
                "accumulated attention recomputed with an extra prefill pass (pass methods=... to kvfold.prefill)"
            )

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return layer.entry_stats[H2OPrefillObserver.key]

    def recent_counts(self, budget: Tensor) -> Tensor:
        """Recent tokens kept out of a budget: ``⌊recent_ratio · budget⌋``."""
        return torch.floor(budget.double() * self.recent_ratio).long()

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        recent = self.recent_counts(self.layer_budgets(ctx)[layer_idx])
        return _last_valid(valid, recent) | _first_valid(valid, self.sinks)

    def online_policy(self, ctx: CompressionContext) -> H2OOnline | None:
        if not self.online:
            return None
        limits = _online_limits(self, ctx)
        recent = int(self.recent_counts(torch.tensor(max(limits.values()))))
        return H2OOnline(limits, recent=recent, sinks=self.sinks)


# ---------------------------------------------------------------------------- TOVA


class TOVAOnline(OnlineEviction):
    """Online TOVA: each step, scores are the new token's attention (head-averaged over the
    layer); the lowest goes, never the newest token."""

    def __init__(self, limits: dict[int, int]) -> None:
        super().__init__(limits, needs_attention=True, recent=1)

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        return torch.zeros(layer.batch_size, layer.num_heads, count, device=layer.device)  # replaced each step

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        if probs is None:
            return state.new_zeros(state.shape[0], state.shape[1], q_len)
        _, _, log_mass = layer.dense_buffers()
        scores = tova_scores(probs, layer.num_heads, valid=torch.isfinite(log_mass))
        old = state.shape[-1]
        state.copy_(scores[..., :old].to(state.dtype))
        return scores[..., old:]


@register
@dataclass
class TOVA(Selector):
    """TOVA, Token Omission Via Attention (Oren et al. 2024, arXiv:2401.06104, §3, the TOVA policy).

    Keeps the entries with the highest attention from the **last** query, averaged over all query
    heads of the layer (so every KV head keeps the same tokens). One-shot: the last context
    token's query; online (default): each new token's query. Only the newest token is protected.

    Parameters:
        online: keep the budget during decoding too (TOVA is a decode-time policy).
    """

    name: ClassVar[str] = "tova"
    description: ClassVar[str] = "attention of the last query, averaged over the layer's heads; online"
    paper: ClassVar[str] = "Oren et al. 2024, Transformers are Multi-State RNNs"
    query_window: ClassVar[int] = 1
    supports_chunked_prefill: ClassVar[bool] = True
    online: bool = True

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, beta, valid = _content(layer)
        last = _window_queries(layer, 1, self.name)
        probs = window_attention(last, keys, _scaling(ctx, layer_idx, layer), log_mass=beta, valid=valid)
        return tova_scores(probs, layer.num_heads, valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=1, valid=valid)

    def online_policy(self, ctx: CompressionContext) -> TOVAOnline | None:
        return TOVAOnline(_online_limits(self, ctx)) if self.online else None


# ---------------------------------------------------------------------------- K-norm


class KNormOnline(OnlineEviction):
    """Online K-norm: every entry keeps the score ``−‖k‖`` it was born with; sinks protected."""

    def __init__(self, limits: dict[int, int], sinks: int) -> None:
        super().__init__(limits)
        self.sinks = sinks

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        keys, _, log_mass = layer.dense_buffers()
        valid = torch.isfinite(log_mass[:, :, :count])
        scores = knorm_scores(keys[:, :, :count], valid).float()
        return scores.masked_fill(_first_valid(valid, self.sinks), PROTECTED)

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        keys, _, _ = layer.dense_buffers()
        return knorm_scores(keys[:, :, -q_len:]).float()


@register
@dataclass
class KNorm(Selector):
    """K-norm (Devoto et al. 2024, arXiv:2406.11430, §3–4): keys with a low L2 norm attract
    attention, so keep the entries with the smallest ``‖k‖``.

    No sinks by default, as in the authors' release (kvpress): the paper's observation is that
    attention sinks are exactly the lowest-norm keys, so they are kept anyway.

    Parameters:
        sinks: first tokens always kept (0 = none).
        online: keep the budget during decoding too (score of a new entry: its key norm).
    """

    name: ClassVar[str] = "knorm"
    description: ClassVar[str] = "keep the entries with the lowest key norm; online during decoding"
    paper: ClassVar[str] = "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
    supports_chunked_prefill: ClassVar[bool] = True
    sinks: int = 0
    online: bool = True

    def validate(self) -> None:
        if self.sinks < 0:
            raise SpecError(f"knorm: sinks must be ≥ 0; got {self.sinks}")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, _, valid = _content(layer)
        return knorm_scores(keys, valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return _first_valid(layer.valid_mask(), self.sinks) if self.sinks else None

    def online_policy(self, ctx: CompressionContext) -> KNormOnline | None:
        return KNormOnline(_online_limits(self, ctx), sinks=self.sinks) if self.online else None


# ---------------------------------------------------------------------------- Expected Attention


@register
@dataclass
class ExpectedAttention(Selector):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution", §3).

    Future queries are modelled as a Gaussian fitted to recent **pre-RoPE** queries, rotated by
    the mean RoPE rotation of the next ``n_future`` positions; each entry's score is its expected
    attention times ``‖v‖`` (:func:`kvfold.methods.scoring.expected_attention_scores`). Pre-RoPE
    queries come from the captured post-RoPE ones by the inverse rotation (RoPE is orthogonal),
    with the model's own rotary tables. The first ``sinks`` tokens are left out of the query
    statistics and of the softmax, and always kept.

    Difference from the release: it fits the statistics on all prompt queries; here they come
    from the last ``window`` queries captured at prefill (64 by default).

    Parameters:
        n_future: future positions averaged over (512).
        sinks: initial tokens excluded and kept (4).
        window: recent queries for the Gaussian (≤ what the prefill captured).
        use_covariance: include the ``kᵀΣk/2d`` term.
        use_value_norm: weight by ``‖v‖₂``.
        epsilon: added before the value-norm weighting.
    """

    name: ClassVar[str] = "expected_attention"
    description: ClassVar[str] = "expected attention of future queries (Gaussian of recent queries) x value norm"
    paper: ClassVar[str] = (
        "Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating Attention "
        "from Future Queries Distribution"
    )
    n_future: int = 512
    sinks: int = 4
    window: int = 64
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        for option in ("n_future", "window"):
            if getattr(self, option) < 1:
                raise SpecError(f"expected_attention: {option} must be ≥ 1; got {getattr(self, option)}")
        if self.sinks < 0 or self.epsilon < 0:
            raise SpecError("expected_attention: sinks and epsilon must be ≥ 0")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, values, beta, valid = _content(layer)
        captured = _window_queries(layer, self.window, self.name, strict=False)
        sinks = _first_valid(valid, self.sinks)
        key_valid = valid & ~sinks
        lengths = valid[:, 0].sum(-1).tolist()  # tokens per row (left padding excluded)
        rows = []
        for b in range(keys.shape[0]):  # per batch row: rows differ in length, so in positions
            row = slice(b, b + 1)
            rows.append(
                self._row_scores(
                    ctx, layer_idx, int(lengths[b]), captured[row], keys[row], values[row], beta[row], key_valid[row]
                )
            )
        scores = torch.cat(rows)
        # sinks are protected; give them the row's top score so that scores stay finite
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        return torch.where(sinks, top.expand_as(scores), scores)

    def _row_scores(
        self,
        ctx: CompressionContext,
        layer_idx: int,
        length: int,
        captured: Tensor,
        keys: Tensor,
        values: Tensor,
        beta: Tensor,
        key_valid: Tensor,
    ) -> Tensor:
        """Scores of one batch row of ``length`` tokens, ``(1, H_kv, N)``."""
        width = captured.shape[2]
        positions = torch.arange(length - width, length, device=keys.device)  # of the captured queries
        use = positions >= min(self.sinks, length - 1)  # real tokens past the sinks (at least one)
        cos, sin = rope_tables(ctx.model, layer_idx, positions[use])
        queries = unrotate(captured[:, :, use], cos, sin)  # pre-RoPE (1, H_q, M, D)
        future = torch.arange(length, length + self.n_future, device=keys.device)
        cos_f, sin_f = rope_tables(ctx.model, layer_idx, future)
        return expected_attention_scores(
            queries,
            keys,
            values,
            cos_f,
            sin_f,
            _scaling(ctx, layer_idx, ctx.cache.layers[layer_idx]),
            use_covariance=self.use_covariance,
            use_value_norm=self.use_value_norm,
            epsilon=self.epsilon,
            log_mass=beta,
            valid=key_valid,
        )

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return _first_valid(layer.valid_mask(), self.sinks) if self.sinks else None


# ---------------------------------------------------------------------------- KVzip

REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_NEXT = "Repeat the part of the previous context exactly, starting with"


@dataclass
class RepeatPrompt:
    """Token ids of KVzip's reconstruction prompt (Kim et al. 2025, §3.1 and Appendix).

    The repeat input of chunk ``i`` is ``first`` (i = 0) or ``next`` + the last ``overlap`` tokens
    of chunk ``i − 1``, then ``tail`` (end of the user turn, assistant header), then the chunk.
    ``prefix`` holds the ids of the template that precedes the context text (not repeated).
    """

    first: list[int]
    next: list[int]
    tail: list[int]
    prefix: list[int]

    @classmethod
    def build(cls, tokenizer: Any) -> RepeatPrompt:
        """From the tokenizer (chat template when it has one); all empty without a tokenizer."""
        if tokenizer is None:
            return cls([], [], [], [])
        head, first, tail = template_parts(tokenizer, REPEAT_FIRST)
        _, following, _ = template_parts(tokenizer, REPEAT_NEXT)
        return cls(
            first=encode(tokenizer, first, special=False),
            next=encode(tokenizer, following, special=False),
            tail=encode(tokenizer, tail, special=False) if tail else [],
            prefix=encode(tokenizer, head, special=True),
        )

    def chunk_inputs(self, row_ids: list[int], chunk: int, overlap: int = 8) -> list[list[int]]:
        """The repeat inputs of one context row, chunk by chunk."""
        start = len(self.prefix) if self.prefix and row_ids[: len(self.prefix)] == self.prefix else 0
        text = row_ids[start:] or row_ids
        pieces = [text[lo : lo + chunk] for lo in range(0, len(text), chunk)]
        inputs = []
        for i, piece in enumerate(pieces):
            prompt = self.first if i == 0 else self.next + pieces[i - 1][-overlap:]
            inputs.append(prompt + self.tail + piece)
        return inputs


class RepeatAttentionRecorder:
    """Online-policy hook for KVzip's repeat pass: per layer, the max attention each context entry
    receives from the repeat input's queries, max over the GQA group (Kim et al. 2025, §3)."""

    needs_attention = True

    def __init__(self, context_slots: int) -> None:
        self.context_slots = context_slots
        self.scores: dict[int, Tensor] = {}

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        if probs is None:
            raise RuntimeError("KVzip's repeat pass needs attention probabilities from a filled dense cache")
        received = probs[..., : self.context_slots].amax(dim=2)  # max over queries, (B, H_q, N)
        received = pool_gqa(received, layer.num_heads, "max")  # max over the GQA group
        previous = self.scores.get(layer_idx)
        self.scores[layer_idx] = received if previous is None else torch.maximum(previous, received)


def kvzip_scores(ctx: CompressionContext, chunk: int) -> dict[int, Tensor]:
    """KVzip importance ``(B, H_kv, N)`` of every folded layer from repeat passes over copies of
    ``ctx.cache`` (one batch row and one chunk at a time, so memory stays bounded)."""
    prompt = RepeatPrompt.build(ctx.tokenizer)
    batch, width = ctx.input_ids.shape
    lengths = ctx.context_lengths.tolist()
    per_row: list[dict[int, Tensor]] = []
    for b in range(batch):  # rows differ in length: their repeat inputs differ
        row_cache = ctx.cache  # never modified: every chunk runs on its own copy
        if batch > 1:
            row_cache = ctx.cache.copy()
            row_cache.batch_select_indices(torch.tensor([b], device=ctx.input_ids.device))
        row_ids = ctx.input_ids[b, width - lengths[b] :].tolist()
        recorder = RepeatAttentionRecorder(width)
        for ids in prompt.chunk_inputs(row_ids, chunk):
            work = row_cache.copy()
            work.policy = recorder
            positions = torch.arange(lengths[b], lengths[b] + len(ids), device=ctx.input_ids.device)
            with torch.no_grad():
                ctx.model(
                    input_ids=torch.tensor([ids], device=ctx.input_ids.device),
                    past_key_values=work,
                    position_ids=positions[None],
                    use_cache=True,
                    logits_to_keep=1,
                )
        per_row.append(recorder.scores)
    scores = {}
    for layer_idx, layer in ctx.cache.folded_layers:
        stacked = torch.cat([row[layer_idx] for row in per_row])
        scores[layer_idx] = stacked.masked_fill(~layer.valid_mask(), float("-inf"))
    return scores


def global_head_counts(
    scores: dict[int, Tensor], protected: dict[int, Tensor], valid: dict[int, Tensor], row_budgets: Tensor
) -> dict[int, Tensor]:
    """Per (layer, head) counts from one ranking over all layers and heads of each batch row.

    Each row keeps ``budget · H · L`` entries in total (protected first, then by score; ties to the
    lower layer, head, position), as KVzip's default non-uniform allocation.
    """
    layers = list(scores)
    stack = torch.stack([scores[i] for i in layers], dim=1)  # (B, L, H, N)
    batch, num_layers, heads, length = stack.shape
    flat = stack.reshape(batch, 1, -1)
    prot = torch.stack([protected[i] for i in layers], dim=1).reshape(batch, 1, -1)
    ok = torch.stack([valid[i] for i in layers], dim=1).reshape(batch, 1, -1)
    totals = row_budgets.to(flat.device)[:, None] * heads * num_layers
    keep, lengths = topk_keep(flat, totals, protected=prot, valid=ok)
    in_row = torch.arange(keep.shape[-1], device=keep.device)[None, :] < lengths  # (B, K)
    owner = keep[:, 0] // length  # layer · H + head
    counts = torch.zeros(batch, num_layers * heads, dtype=torch.long, device=keep.device)
    counts.scatter_add_(1, owner, in_row.long())
    counts = counts.view(batch, num_layers, heads)
    return {layer_idx: counts[:, j] for j, layer_idx in enumerate(layers)}


@register
@dataclass
class KVzip(Selector):
    """KVzip (Kim et al. 2025, arXiv:2505.23416, §3): query-agnostic scores from context
    reconstruction.

    The model reads "repeat the previous context" and the context again on a **copy** of the
    prefilled cache; an entry's score is the maximum attention it receives from the repeat
    input's queries (max over queries and over the GQA group). The repeat runs ``chunk`` tokens
    at a time (the paper's 2K chunks, each with the "starting with …" prompt and the last 8
    tokens of the previous chunk). By default entries are ranked across all layers and heads at
    once (the paper's non-uniform allocation: the cache total matches the budget); with
    ``layerwise=true`` every layer keeps the same budget (then ``adakv:kvzip`` spreads it over
    heads). The first ``sinks`` tokens are kept.

    Differences from the release: the scores use the attention over the whole context (the
    release restricts the softmax to the chunk's own entries and the sinks, for speed), and a
    chunk's queries score every entry (max over chunks). Cost: about two extra prefills.

    Parameters:
        chunk: tokens of context repeated per pass (2048).
        sinks: first tokens always kept (4).
        layerwise: same budget in every layer instead of one ranking over all layers.
    """

    name: ClassVar[str] = "kvzip"
    description: ClassVar[str] = "query-agnostic: max attention received while the model repeats the context"
    paper: ClassVar[str] = "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
    chunk: int = 2048
    sinks: int = 4
    layerwise: bool = False

    def validate(self) -> None:
        if self.chunk < 1 or self.sinks < 0:
            raise SpecError(f"kvzip: chunk must be ≥ 1 and sinks ≥ 0; got chunk={self.chunk}, sinks={self.sinks}")

    def prepare(self, ctx: CompressionContext) -> None:
        scores = kvzip_scores(ctx, self.chunk)
        ctx.memo["kvzip_scores"] = scores
        if not self.layerwise:
            layers = dict(ctx.cache.folded_layers)
            valid = {i: layers[i].valid_mask() for i in scores}
            protected = {i: self.protected(i, layers[i], ctx) for i in scores}
            ctx.memo["kvzip_counts"] = global_head_counts(scores, protected, valid, ctx.row_budgets)

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return ctx.memo["kvzip_scores"][layer_idx]

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return _first_valid(layer.valid_mask(), self.sinks)

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        budgets = super().layer_budgets(ctx)
        for layer_idx, counts in ctx.memo.get("kvzip_counts", {}).items():
            budgets[layer_idx] = counts.max(dim=1).values.cpu()  # the layer is skipped only if no head evicts
        return budgets

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        global_counts = ctx.memo.get("kvzip_counts")
        return counts if global_counts is None else global_counts[layer_idx].to(counts.device)


# ---------------------------------------------------------------------------- wrappers


@register
@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550, §3–4, Algorithm 1): the layer's budget is
    spread over its KV heads by choosing the top entries of all heads jointly, with the α
    safeguard (each head first gets ``α`` of its uniform share). Rows of different lengths are
    stored paged, so the memory held follows the per-head budgets (nothing is masked).

    Parameters:
        alpha: safeguard fraction (0.2 in the paper; 1 = uniform budgets).
    """

    name: ClassVar[str] = "adakv"
    description: ClassVar[str] = "per-head budgets across the heads of a layer (alpha safeguard 0.2), real lengths"
    paper: ClassVar[str] = (
        "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient "
        "LLM Inference"
    )
    alpha: float = 0.2

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"adakv: alpha must be in [0, 1]; got {self.alpha}")

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        valid = layer.valid_mask()
        return adakv_head_budgets(scores, counts, alpha=self.alpha, protected=protected, valid=valid)


@register
@dataclass
class CriticalKV(Wrapper):
    """CriticalKV (Feng et al. 2025, arXiv:2502.03805, §3–4): output-aware selection.

    Scores are reweighted by the size of what the entry writes to the layer output,
    ``(a + ε)·‖W_oʰ v‖₁`` (:func:`kvfold.methods.scoring.critical_reweight`), and selection is
    two-stage: the first ``first_stage`` share of each head's budget by the inner scorer's
    attention scores, the rest by the reweighted scores. Needs non-negative attention-like
    scores from the inner scorer (not knorm, random or streamingllm).

    Parameters:
        first_stage: share of the budget chosen by attention scores (0.5 in the paper).
        epsilon: ``ε`` added to the attention score.
    """

    name: ClassVar[str] = "criticalkv"
    description: ClassVar[str] = "reweight scores by ||W_o v||_1 (output-aware), two-stage selection (0.5)"
    paper: ClassVar[str] = (
        "Feng et al. 2025, Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
    )
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def validate(self) -> None:
        if not 0.0 <= self.first_stage <= 1.0 or self.epsilon < 0:
            raise SpecError("criticalkv: first_stage must be in [0, 1] and epsilon ≥ 0")

    def rescore(self, layer_idx: int, layer: FoldedLayer, scores: Tensor, ctx: CompressionContext) -> Tensor:
        _, values, _, valid = _content(layer)
        if bool((scores[valid] < 0).any()):
            raise ValueError(
                "criticalkv reweights attention scores (≥ 0); the inner method gives negative scores "
                "(use an attention-based scorer such as snapkv, h2o, tova, kvzip or expected_attention)"
            )
        weight = o_proj_weight(ctx, layer_idx)
        return critical_reweight(
            scores, values, weight, layer.num_heads, layer.head_dim, epsilon=self.epsilon, valid=valid
        )

    def select(self, layer_idx, layer, received, scores, counts, protected, valid, ctx):
        return critical_two_stage_select(received, scores, counts, self.first_stage, protected, valid)
