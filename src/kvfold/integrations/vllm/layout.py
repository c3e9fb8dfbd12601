"""What the vLLM plugin serves, and where a served question's positions come from.

A cache file is served to vLLM one context a file, query-agnostic, every layer a full-attention
layer (:func:`check_servable`); its rows are then laid into the request's blocks at their own bytes
(:mod:`kvfold.integrations.vllm.pool_layout`).

Positions: kvfold's keys are stored rotated (RoPE) at the positions the context had, and the
question follows at the logical length T. vLLM computes the question's positions as the prompt's
token index, and the served prompt is ``P`` placeholder tokens then the question: its first token
sits at ``P``, not T. RoPE logits depend only on ``query position − key position``, so the backend
turns the question's queries by ``T − P`` (:func:`rotate_keys` applies to queries as to keys) for
the file's entries: each question token then sees every entry at the distance it has at T, T+1, …
This holds for RoPE whose rotation angle is linear in the position (``default``, ``linear``,
``llama3``); other RoPE types are refused.

Nothing here imports vLLM: plain torch, tested on its own.
"""

from __future__ import annotations

import os

import torch

from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.models import rope_settings
from kvfold.runtime.pool_attention import turn, turn_table

LINEAR_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE types whose angle is a fixed frequency times the position (so a query can be turned)."""


class UnservableCacheError(UserError):
    """A cache file that the vLLM plugin cannot serve; the message says why in one line."""


def rope_inverse_frequencies(config) -> torch.Tensor:
    """``(D/2,)`` float64: RoPE's angle per position of each rotated pair, as transformers computes it.

    Raises:
        UnservableCacheError: a RoPE type whose angle is not linear in the position (dynamic, YaRN, …).
    """
    params = rope_settings(config)[0]  # the served families have one RoPE for every layer
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
    """Keys or queries (``(..., D)``, RoPE's half-split layout) rotated as if their positions moved by
    ``shift``. Computed in float64 and returned in the input's dtype
    (:func:`kvfold.runtime.pool_attention.turn`)."""
    return turn(keys, turn_table(inv_freq, shift))


def check_servable(cache: FoldedCache, header: dict) -> None:
    """Refuse what the plugin cannot serve, with one line that says why.

    Raises:
        UnservableCacheError: a batch of several contexts, sliding-window layers, query-aware caches
            (their question is inside), an empty cache, or layers that disagree on the context's length.
    """
    extra = header.get("extra") or {}
    if extra.get("query_aware_suffixes"):
        raise UnservableCacheError(
            "a query-aware cache holds its question already; serve a query-agnostic one (kvfold compress)"
        )
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, FoldedLayer):
            raise UnservableCacheError(f"layer {index} is a sliding-window layer, which the vLLM plugin does not serve")
        if not layer.is_initialized:
            raise UnservableCacheError(f"layer {index} is empty")
        if layer.batch_size != 1:
            raise UnservableCacheError(
                f"the file holds a batch of {layer.batch_size} contexts; the vLLM plugin serves one context a file"
            )
    lengths = {layer.logical_length for layer in cache.layers}
    if len(lengths) != 1:
        raise UnservableCacheError("its layers disagree on the context's length")


def read_cache_file(path: str | os.PathLike, config, *, verify: bool = True) -> tuple[FoldedCache, dict]:
    """A cache file's content as a :class:`FoldedCache` and its header, without a model, checked for serving.

    The file's own checks run (:func:`kvfold.store.load.read_cache`: format, version, truncation,
    checksum, every tensor against the header); the model fingerprint is not checked here
    (:meth:`CacheCatalog.check <kvfold.integrations.vllm.requests.CacheCatalog.check>` does it).

    Raises:
        kvfold.store.format.CacheFileError: a missing, damaged or altered file.
        UnservableCacheError: see :func:`check_servable`.
    """
    from kvfold.store.load import read_cache

    cache, info = read_cache(path, config, verify=verify)
    check_servable(cache, info.header)
    return cache, info.header
