"""What methods read from the model: its attention modules, their logit scale, ``W_o``, RoPE, and
an extra prefill pass of the context.

Found by the rule :func:`kvfold.enable` uses (:func:`kvfold.runtime.attention.attention_modules`) and
cached in ``ctx.memo``; RoPE tables come from the model's own rotary module (so its scaling variants hold).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PreTrainedModel

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.runtime.attention import attention_modules, attention_scalings
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

# ---------------------------------------------------------------------------- shared helpers


def model_name(model: PreTrainedModel) -> str:
    """The model's hub id or directory (``config.name_or_path``), else its class name: how
    reports, resumable runs and saved schedules name the model."""
    return str(getattr(model.config, "name_or_path", "") or type(model).__name__)


def attention_module(ctx: CompressionContext, layer_idx: int) -> torch.nn.Module:
    """The attention module of layer ``layer_idx`` (:func:`kvfold.runtime.attention.attention_modules`,
    found once per compression and kept in ``ctx.memo``).

    Raises:
        ValueError: the model has no attention module for that layer.
    """
    modules = ctx.memo.get("attention_modules")
    if modules is None:
        modules = ctx.memo["attention_modules"] = attention_modules(ctx.model)
    if layer_idx not in modules:
        raise UserError(
            f"found no attention module for layer {layer_idx} in {type(ctx.model).__name__} "
            "(expected modules with `layer_idx` and `o_proj`, as in Llama, Mistral, Qwen and Gemma3)"
        )
    return modules[layer_idx]


def layer_scaling(ctx: CompressionContext, layer_idx: int, layer: FoldedLayer, require_module: bool = False) -> float:
    """The layer's logit scale: its attention module's ``scaling``, else ``1/√D`` (``D`` the layer's
    head dim). The scales are read once per compression
    (:func:`kvfold.runtime.attention.attention_scalings`) and kept in ``ctx.memo``.

    Args:
        require_module: raise when the model has no attention module for the layer (else ``1/√D``).

    Raises:
        ValueError: ``require_module`` and no attention module for ``layer_idx``.
    """
    if require_module:
        attention_module(ctx, layer_idx)
    scales = ctx.memo.get("attention_scalings")
    if scales is None:
        scales = ctx.memo["attention_scalings"] = attention_scalings(ctx.model)
    scale = scales.get(layer_idx)
    return scale if scale is not None else layer.head_dim**-0.5


def o_proj_weight(ctx: CompressionContext, layer_idx: int) -> Tensor:
    """``W_o`` ``(hidden, H_q·D)`` of a layer's attention (CriticalKV's output projection)."""
    module = attention_module(ctx, layer_idx)
    weight = getattr(module.o_proj, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"layer {layer_idx}: o_proj has no 2-D weight (quantized modules are not supported)")
    return weight


def rotate_half(x: Tensor) -> Tensor:
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
    return (y * cos - rotate_half(y) * sin) / (cos * cos + sin * sin)


def pre_rope_keys(ctx: CompressionContext, layer_idx: int, layer: FoldedLayer) -> Tensor:
    """The layer's keys before RoPE, ``(B, H_kv, N, D)`` float32 (float64 for a float64 cache).

    The cache holds rotated keys ``R_t k``; RoPE is a rotation at a known position, so
    :func:`unrotate` with the model's own tables gives ``k`` back exactly (up to rounding) — no
    hook and no extra pass. The position of a slot is its rank among the row's valid entries
    (left padding skipped, as the prefill's ``position_ids``), which holds only while the layer
    is uncompressed (one slot per position seen).

    Raises:
        ValueError: the layer was already compressed (slots no longer map to positions).
    """
    keys, _, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    if layer.stored is not None or layer.physical_length != layer.logical_length:
        raise UserError(
            f"layer {layer_idx} holds {layer.physical_length} entries for {layer.logical_length} positions: "
            "pre-RoPE keys need an uncompressed prefill (slot = position); compress the full context "
            "instead of a chunked or already compressed cache"
        )
    positions = (valid[:, 0].long().cumsum(-1) - 1).clamp_min(0)  # (B, N): as the prefill's position_ids
    out = torch.empty(keys.shape, dtype=torch.promote_types(keys.dtype, torch.float32), device=keys.device)
    for b in range(keys.shape[0]):  # rows differ in padding, so in positions
        cos, sin = rope_tables(ctx.model, layer_idx, positions[b])
        out[b] = unrotate(keys[b], cos, sin)
    return out


def observe_prefill(ctx: CompressionContext, observers: list) -> None:
    """Re-run the prefill of ``ctx.input_ids`` with prefill observers and copy their statistics
    into ``ctx.cache`` (for a context prefilled without them). Costs one extra forward pass."""
    model = ctx.model
    if model.config._attn_implementation != "kvfold":
        raise ValueError("prefill statistics need the kvfold attention: call kvfold.enable(model) first")
    scratch = FoldedCache(model.config)
    scratch.prefill_observers = list(observers)
    prefill_again(ctx, scratch)
    for layer_idx, layer in ctx.cache.folded_layers:
        for observer in observers:
            layer.entry_stats[observer.key] = scratch.layers[layer_idx].entry_stats[observer.key]


def prefill_again(ctx: CompressionContext, scratch: FoldedCache) -> None:
    """Run the prefill of ``ctx.input_ids`` once more into ``scratch`` (an empty cache set up with
    what the caller needs: a query window to capture, prefill observers), as the pipeline ran it:
    left-padded rows with positions from the attention mask, one logit kept."""
    ids, mask = ctx.input_ids, ctx.attention_mask
    if mask is None:
        mask = torch.ones_like(ids)
    with torch.no_grad():
        ctx.model(
            input_ids=ids,
            attention_mask=mask if ids.shape[0] > 1 else None,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=scratch,
            use_cache=True,
            logits_to_keep=1,
        )
