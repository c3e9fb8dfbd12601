"""Writing saved caches: :func:`save_cache` (a :class:`~kvfold.runtime.cache.FoldedCache`) and
:func:`save_context` (a :class:`~kvfold.pipeline.context.CompressedContext`).

The file format (header, fingerprint, checksum) is :mod:`kvfold.store.format`; a file is written to a
temporary name, synced and renamed into place (:func:`kvfold.runtime.files.atomic_path`), so a reader,
or a process killed in the middle of a save, never sees half a file; a failed write raises an
:class:`~kvfold.runtime.files.OutputError` that names the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvfold.pipeline.context import CompressedContext
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.files import atomic_path
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.store.format import (
    FORMAT,
    FORMAT_VERSION,
    METADATA_KEY,
    CacheFileError,
    checksum,
    dtype_name,
    kvfold_version,
    model_fingerprint,
)
from kvfold.store.layer_tensors import layer_tensors

__all__ = ["save_cache", "save_context"]


def save_cache(
    cache: FoldedCache,
    path: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer=None,
    *,
    method: str | None = None,
    budget: float | int | None = None,
    context_tokens: int | list[int] | None = None,
    source_text: str | None = None,
    token_ids: torch.Tensor | None = None,
    include_tokens: bool = False,
    queries: bool = False,
    last_logits: torch.Tensor | None = None,
    extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> int:
    """Write ``cache`` to ``path`` (atomically: a temporary file renamed into place).

    Args:
        cache: the cache to save (not modified).
        path: the file to write (``.kvc`` by convention).
        model: the model that made the cache; its fingerprint is checked when loading.
        tokenizer: its tokenizer (vocabulary hash), or None.
        method: the method spec the cache was compressed with (informative; used to continue
            online methods and to compact a saved chat again).
        budget: the budget label (``"0.1"``, ``"512"``).
        context_tokens: the context's token count (per batch row for a batch).
        source_text: the context text; only its SHA-256 is stored.
        token_ids: ``(B, N)`` the context tokens: their SHA-256 goes into the header.
        include_tokens: also store ``token_ids`` (4 bytes a token; a chat compacted again with a
            method that re-reads its context, e.g. Attention Matching, needs them).
        queries: store the captured prefill queries (online Attention Matching reads them).
        last_logits: ``(B, V)`` the last prefill logits (query-aware caches decode from them).
        extra: more JSON-serializable header fields (e.g. a chat's state).
        extra_tensors: more tensors, stored as ``extra.<name>`` (e.g. a chat's query window).

    Returns:
        The size of the written file in bytes.

    Raises:
        CacheFileError: an empty cache, or a layer kvfold does not save.
        OutputError: the file cannot be written (its path and what to do; an old file is left whole).
    """
    folded = [layer for _, layer in cache.folded_layers if layer.is_initialized]
    if not folded:
        raise CacheFileError("the cache is empty: prefill a context before saving it")
    layers, tensors = _layer_tensors(cache, queries)
    if token_ids is not None and include_tokens:
        tensors["context.token_ids"] = token_ids.detach().to(torch.int32).contiguous()
    if last_logits is not None:
        tensors["context.last_logits"] = last_logits.detach().contiguous()
    for name, tensor in (extra_tensors or {}).items():
        tensors[f"extra.{name}"] = tensor.detach().contiguous()
    tensors = {name: t.cpu() for name, t in tensors.items()}
    if isinstance(context_tokens, int):
        context_tokens = [context_tokens]
    header: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvfold_version": kvfold_version(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_fingerprint(model, tokenizer),
        "dtype": dtype_name(folded[0].dtype),
        "device": str(folded[0].device),
        "method": method,
        "budget": budget,
        "context_tokens": context_tokens,
        "source_sha256": hashlib.sha256(source_text.encode("utf-8")).hexdigest() if source_text else None,
        "tokens_sha256": _token_hash(token_ids) if token_ids is not None else None,
        "layers": layers,
        "live_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("layer.")),
        **_byte_counts(cache),
        "extra": extra or {},
    }
    header["checksum"] = {"algorithm": "sha256", "value": checksum(header, tensors.items())}
    return _write(tensors, header, Path(path))


def _byte_counts(cache: FoldedCache) -> dict[str, Any]:
    """The header's byte counts: what the cache holds, the full cache, both in the dtype held and at
    16 bits, and the storage format (None: unquantized)."""
    return {
        "kv_bytes_full": cache.full_nbytes(),
        "kv_bytes": cache.content_nbytes(),
        "kv_bytes_16": cache.content_nbytes(sixteen_bit=True),
        "kv_bytes_full_16": cache.full_nbytes(sixteen_bit=True),
        "kv_format": None if cache.quant is None else cache.quant.describe(),
    }


def _layer_tensors(cache: FoldedCache, queries: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The header's per-layer layout and the tensors every layer physically holds (live entries only)."""
    layers, tensors = [], {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, FoldedLayer):
            if not layer.is_initialized:
                layers.append({"kind": "empty"})
                continue
            layout, content = layer_tensors(layer, queries=queries)
            layers.append(
                {
                    "kind": "folded",
                    "layout": layout,
                    "logical_length": layer.logical_length,
                    "batch_size": layer.batch_size,
                    "num_heads": layer.num_heads,
                    "entries": int(layer.row_lengths().sum()),
                    **({"kv_format": layer.stored.config.describe()} if layer.is_quantized else {}),
                }
            )
            tensors.update({f"layer.{index}.{name}": t for name, t in content.items()})
        elif isinstance(layer, DynamicSlidingWindowLayer):
            if not layer.is_initialized:
                layers.append({"kind": "empty"})
                continue
            layers.append({"kind": "sliding", "cumulative_length": int(layer.cumulative_length)})
            tensors[f"layer.{index}.keys"] = layer.keys.detach().contiguous()
            tensors[f"layer.{index}.values"] = layer.values.detach().contiguous()
        else:
            raise CacheFileError(
                f"layer {index} is a {type(layer).__name__}; kvfold cache files hold FoldedCache layers"
            )
    return layers, tensors


def _token_hash(token_ids: torch.Tensor) -> str:
    return hashlib.sha256(token_ids.detach().to(torch.int64).cpu().numpy().tobytes()).hexdigest()


def _write(tensors: dict[str, torch.Tensor], header: dict[str, Any], target: Path) -> int:
    """Write a safetensors file with the header as its metadata, atomically; its size in bytes.

    Raises:
        OutputError: the file cannot be written (an old file at ``target`` is left whole).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with atomic_path(target) as tmp:
        try:
            save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
        except SafetensorError as err:
            raise _os_error(err, tmp) from err
    return target.stat().st_size


def _os_error(err: Exception, path: Path) -> Exception:
    """safetensors' I/O error as the :class:`OSError` it wraps (``... (os error 28) ...``); others unchanged."""
    message = str(err)
    found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", message)
    if found is None:
        return err
    return OSError(int(found.group(2)), found.group(1), str(path))


def save_context(
    compressed: CompressedContext,
    path: str | os.PathLike,
    *,
    source_text: str | None = None,
    resumable: bool = False,
    extra: dict[str, Any] | None = None,
) -> int:
    """Write a compressed context (its cache, method, budget and token count) to a cache file.

    Load it back with :func:`kvfold.store.load.load_context` (answers are those of ``compressed``),
    or continue it as a chat with :func:`kvfold.store.chat.load_chat`.

    Args:
        compressed: the compressed context.
        path: the file to write (``.kvc`` by convention).
        source_text: the context text (only its hash is stored).
        resumable: also store the context's token ids and the last query states of every layer,
            so that a chat on this file (:func:`kvfold.store.chat.load_chat`) can compact it again
            with any method (Attention Matching re-reads the tokens, SnapKV reads the queries).
            Costs 4 bytes a token plus the query window; off by default. Online methods always
            store the query states (their policy reads them).
        extra: more header fields.

    Returns:
        The size of the file in bytes.

    Example:
        >>> small = kvfold.prefill(model, tokenizer, text).compress("snapkv", 0.1)  # doctest: +SKIP
        >>> kvfold.save_context(small, "doc.kvc", source_text=text)  # doctest: +SKIP
    """
    src = compressed.source
    lengths = [int(n) for n in src.attention_mask.sum(-1).tolist()]
    header_extra = dict(extra or {})
    if src.suffixes is not None:
        header_extra["query_aware_suffixes"] = list(src.suffixes)
    return save_cache(
        compressed.cache,
        path,
        src.model,
        src.tokenizer,
        method=compressed.method.spec,
        budget=compressed.budget.label(),
        context_tokens=lengths,
        source_text=source_text,
        token_ids=src.input_ids,
        include_tokens=resumable,
        queries=compressed.policy is not None or resumable,
        last_logits=src.last_logits if src.suffixes is not None else None,
        extra=header_extra,
    )
