"""A saved kvfold cache laid out for vLLM's paged KV cache: one length for every layer and head,
keys turned to the served positions, β in the widened head's extra channel.

vLLM gives all layers and heads of a request one block table, so one length: a kvfold cache whose
rows (layer × KV head) hold different numbers of entries is served as ``slots`` = its longest row,
shorter rows padded with entries of β = :data:`PAD_BETA` (an attention weight of exactly 0 in
float32, not −inf, so that no kernel meets ``inf − inf``).

Positions: kvfold's keys are stored rotated (RoPE) at the positions the context had, and the
question follows at the logical length T. vLLM computes the question's positions as the prompt's
token index, and the served prompt is ``slots`` placeholder tokens (whose keys and values are these
entries) then the question: its first token sits at ``slots``, not T. RoPE logits depend only on
``query position − key position``, so every stored key is rotated by ``−(T − slots)``: each
question token then sees every entry at the distance it would have at T, T+1, … This holds for RoPE
whose rotation angle is linear in the position (``default``, ``linear``, ``llama3``); other RoPE
types are refused.

Nothing here imports vLLM: the layout is plain torch, so it is tested on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvfold.runtime.cache import FoldedCache, FoldedLayer
from kvfold.runtime.errors import UserError

PAD_BETA = -1.0e4
"""β of the padding entries: exp(−1e4) is 0 in float32 (and in bfloat16), so they receive no attention."""

SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention accepts (``CPUAttentionBackend.get_supported_head_sizes``)."""

LINEAR_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE types whose angle is a fixed frequency times the position (so a key can be turned back)."""


class UnservableCacheError(UserError):
    """A cache file that the vLLM plugin cannot serve; the message says why in one line."""


def wide_head_size(head_dim: int) -> int:
    """The smallest supported head size above ``head_dim``: room for β's channel."""
    for size in SUPPORTED_HEAD_SIZES:
        if size > head_dim:
            return size
    raise UnservableCacheError(f"head size {head_dim} has no wider size in vLLM's CPU attention")


def rope_inverse_frequencies(config) -> torch.Tensor:
    """``(D/2,)`` float64: RoPE's angle per position of each rotated pair, as transformers computes it.

    Raises:
        UnservableCacheError: a RoPE type whose angle is not linear in the position (dynamic, YaRN, …).
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in LINEAR_ROPE_TYPES:
        raise UnservableCacheError(
            f"RoPE type {rope_type!r} is not served (its angle is not linear in the position); "
            f"served: {', '.join(LINEAR_ROPE_TYPES)}"
        )
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.double().cpu()


def rotate_keys(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (``(..., D)``, RoPE's half-split layout) rotated as if their positions moved by ``shift``.

    Computed in float64 and returned in the keys' dtype.
    """
    half = keys.shape[-1] // 2
    angle = shift * inv_freq.to(torch.float64)
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = keys.to(torch.float64)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(keys.dtype)


@dataclass
class ServedLayout:
    """A cache file ready for vLLM's paged cache.

    Attributes:
        logical_length: T, the positions the context had.
        slots: entries per layer and head (the longest row); the served prompt's placeholder count.
        keys: per layer ``(H, slots, W)``: rotated keys, β/scale in channel D, zeros after.
        values: per layer ``(H, slots, W)``: values, zeros after channel D.
    """

    logical_length: int
    slots: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def check_servable(cache: FoldedCache, header: dict) -> None:
    """Refuse what the plugin cannot serve, with one line that says why.

    Raises:
        UnservableCacheError: a batch of several contexts, sliding-window layers, quantized layers,
            query-aware caches (their question is inside), or an empty cache.
    """
    extra = header.get("extra") or {}
    if extra.get("query_aware_suffixes"):
        raise UnservableCacheError(
            "a query-aware cache holds its question already; serve a query-agnostic one (kvfold compress)"
        )
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, FoldedLayer):
            raise UnservableCacheError(f"layer {index} is a sliding-window layer, which the vLLM plugin does not serve")
        if getattr(layer, "is_quantized", False):
            raise UnservableCacheError(
                f"layer {index} is stored quantized; the vLLM plugin serves float caches only (save it unquantized)"
            )
        if not layer.is_initialized:
            raise UnservableCacheError(f"layer {index} is empty")
        if layer.batch_size != 1:
            raise UnservableCacheError(
                f"the file holds a batch of {layer.batch_size} contexts; the vLLM plugin serves one context a file"
            )
    lengths = {layer.logical_length for layer in cache.layers}
    if len(lengths) != 1:
        raise UnservableCacheError("its layers disagree on the context's length")


def slots_of(cache: FoldedCache) -> int:
    """Entries each layer and head is served with: the longest row of any layer."""
    return max(layer.physical_length for _, layer in cache.folded_layers)


def build_layout(cache: FoldedCache, config, *, keep_positions: bool = True) -> ServedLayout:
    """Lay a checked cache (:func:`check_servable`) out for vLLM (module docstring).

    Args:
        cache: the loaded cache.
        config: the model's config (head size, RoPE).
        keep_positions: rotate the keys by ``−(T − slots)`` (what serving needs; False only to show
            in a test that the rotation matters).
    """
    inv_freq = rope_inverse_frequencies(config)
    slots = slots_of(cache)
    logical = cache.layers[0].logical_length
    keys, values = [], []
    for _, layer in cache.folded_layers:
        k, v, beta, _ = layer.padded()  # (1, H, N, D), β = −inf on empty slots
        k, v, beta = k[0], v[0], beta[0]
        heads, n, dim = k.shape
        scale = dim**-0.5
        wide = wide_head_size(dim)
        if keep_positions:
            k = rotate_keys(k, -(logical - slots), inv_freq)
        out_k = k.new_zeros(heads, slots, wide)
        out_v = v.new_zeros(heads, slots, wide)
        out_k[:, :n, :dim] = k
        out_v[:, :n, :dim] = v
        beta = torch.where(torch.isfinite(beta), beta, torch.full_like(beta, PAD_BETA))
        column = torch.full((heads, slots), PAD_BETA, dtype=torch.float32)
        column[:, :n] = beta
        out_k[:, :, dim] = (column / scale).to(k.dtype)
        keys.append(out_k)
        values.append(out_v)
    return ServedLayout(logical_length=logical, slots=slots, keys=keys, values=values)


def read_cache_file(path: str | os.PathLike, config, *, verify: bool = True) -> tuple[FoldedCache, dict]:
    """A cache file's content as a :class:`FoldedCache` and its header, without a model, checked for serving.

    The file's own checks run (:func:`kvfold.store.load.read_cache`: format, version, truncation,
    checksum); the model fingerprint is not checked here (:meth:`CacheCatalog.check
    <kvfold.integrations.vllm.requests.CacheCatalog.check>` does it).

    Raises:
        kvfold.store.format.CacheFileError: a missing, damaged or altered file.
        UnservableCacheError: see :func:`check_servable`.
    """
    from kvfold.store.load import read_cache

    cache, info = read_cache(path, config, verify=verify)
    check_servable(cache, info.header)
    return cache, info.header
