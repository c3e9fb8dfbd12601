"""A cache file laid out for vLLM's blocks at its own bytes: its rows packed into chunks of
one block of one layer (:mod:`kvfold.runtime.row_pool`), a request's blocks of every layer one pool.

A request on such a file holds ``ceil(chunks / layers)`` blocks for the file, and its prompt is that
many blocks of placeholder tokens (:attr:`ServedPool.placeholders`) before the question. The keys keep
their stored positions; the backend turns the question's queries instead
(:mod:`kvfold.integrations.vllm.backend`). Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from kvfold.integrations.vllm.layout import UnservableCacheError, rope_inverse_frequencies
from kvfold.integrations.vllm.settings import head_size
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.pool_attention import PooledFile, pooled_file
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.row_pool import FloatRows, PoolError, PoolPlan, pack_pool, plan_pool


@dataclass(frozen=True)
class ServedPool:
    """A cache file as one request holds it.

    Attributes:
        plan: where its rows lie in the chunks.
        logical_length: T, the positions the context had.
        placeholders: P, the request's placeholder tokens (its file blocks × block size).
        inv_freq: ``(D/2,)`` float64 RoPE frequencies (to turn the queries by ``T − P``).
        block_bytes: bytes one block holds over every layer (the unit a request is charged in).
    """

    plan: PoolPlan
    logical_length: int
    placeholders: int
    inv_freq: torch.Tensor
    block_bytes: int

    @property
    def file_blocks(self) -> int:
        return math.ceil(self.plan.num_chunks / len(self.plan.rows_per_layer))

    @cached_property
    def kernel_file(self) -> PooledFile:
        """The file's tables for the pool kernel (made once, on the first step that reads it): where each
        row's segments lie, and the queries' turn by ``T − P``."""
        return pooled_file(self.plan, self.placeholders, self.logical_length - self.placeholders, self.inv_freq)


def chunk_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer in vLLM's CPU cache: keys and values of ``block_size`` tokens
    for every KV head, in ``dtype``."""
    return config.num_key_value_heads * block_size * 2 * head_size(config) * torch.empty(0, dtype=dtype).element_size()


def pool_rows(cache: FoldedCache) -> list[QuantizedRows] | list[FloatRows]:
    """Each layer's rows of a one-context file: its quantized rows, or its rows at full precision.

    Raises:
        UnservableCacheError: layers some quantized and some not or in different formats
            (``wide``), a quantized layer with
            full-precision entries after its quantized ones, or a batch of several contexts.
    """
    rows: list = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, FoldedLayer) or not layer.is_initialized:
            raise UnservableCacheError(f"layer {index} is a sliding-window layer or empty")
        if layer.batch_size != 1:
            raise UnservableCacheError(f"the file holds a batch of {layer.batch_size} contexts; serve one a file")
        if not layer.is_quantized:
            keys, values, log_mass, _ = layer.padded()
            rows.append(FloatRows.from_padded(keys[0], values[0], log_mass[0]))
        elif layer.physical_length != layer.stored.width:
            raise UnservableCacheError(f"layer {index} holds full-precision entries after its quantized ones")
        else:
            rows.append(layer.stored)
    if len({isinstance(r, QuantizedRows) for r in rows}) > 1:
        raise UnservableCacheError("some layers are stored quantized and others not")
    formats = {r.config.describe() for r in rows if isinstance(r, QuantizedRows)}
    if len(formats) > 1:  # wide layers (``int3[wide=8]``): the pool reads every layer in one format
        raise UnservableCacheError(f"its layers are stored in different formats ({', '.join(sorted(formats))})")
    return rows


def served_pool(cache: FoldedCache, config, block_size: int, dtype: torch.dtype) -> tuple[ServedPool, torch.Tensor]:
    """The file as a request holds it, and its chunks' bytes ``(chunks, chunk_bytes)`` uint8 (rows at full
    precision in ``dtype``, the engine's).

    Raises:
        UnservableCacheError: see :func:`pool_rows`; or a format the pool does not hold.
    """
    rows = [_in_dtype(r, dtype) for r in pool_rows(cache)]
    try:
        plan, chunks = pack_pool(rows, chunk_bytes(config, block_size, dtype))
    except PoolError as err:
        raise UnservableCacheError(str(err)) from None
    return _served(plan, cache, config, block_size), chunks


def served_plan(cache: FoldedCache, config, block_size: int, dtype: torch.dtype) -> ServedPool:
    """:func:`served_pool` without writing the chunks: where the rows will lie, and the placeholders a
    request on the file takes (the API server's check).

    Raises:
        UnservableCacheError: as :func:`served_pool`.
    """
    rows = [_in_dtype(r, dtype) for r in pool_rows(cache)]
    first = rows[0]
    config_q = first.config if isinstance(first, QuantizedRows) else None
    try:
        plan = plan_pool([r.lengths for r in rows], config_q, first.head_dim, first.value_dim,
                         chunk_bytes(config, block_size, dtype), beta=any(r.log_mass is not None for r in rows),
                         dtype=dtype if config_q is None else torch.float32)  # fmt: skip
    except PoolError as err:
        raise UnservableCacheError(str(err)) from None
    return _served(plan, cache, config, block_size)


def _served(plan: PoolPlan, cache: FoldedCache, config, block_size: int) -> ServedPool:
    layers = len(plan.rows_per_layer)
    return ServedPool(
        plan=plan,
        logical_length=int(cache.layers[0].logical_length),
        placeholders=math.ceil(plan.num_chunks / layers) * block_size,
        inv_freq=rope_inverse_frequencies(config),
        block_bytes=plan.chunk_bytes * layers,
    )


def _in_dtype(rows, dtype: torch.dtype):
    """Rows at full precision in the engine's dtype (a float32 file served in bfloat16 holds 16-bit rows);
    quantized rows as they are."""
    if isinstance(rows, FloatRows) and rows.dtype != dtype:
        return FloatRows(rows.lengths, rows.keys.to(dtype), rows.values.to(dtype), rows.log_mass)
    return rows
