"""kvfold's attention backend for vLLM's CPU build: a request on a cache file attends the file's rows
where they lie, as the library holds them (codes, scales, β), inside the request's own KV blocks.

A request on a file (:mod:`kvfold.integrations.vllm.connector`) has ``P`` placeholder tokens, ``P``
a whole number of blocks, then the question. Its first ``P / block_size`` blocks, over every layer,
hold the file's chunks (:mod:`kvfold.runtime.row_pool`): chunk ``c`` fills block ``c // L`` of layer
``c % L``. The engine never writes those blocks (their tokens are matched externally), and nothing
reads them as keys and values.

:class:`KvfoldAttentionImpl` is vLLM's ``CPU_ATTN`` (the same cache layout, the same cache write) with
the requests on files taken out of its call: once a step, the step's requests on files become a table
(:class:`~kvfold.runtime.pool_attention.PoolStep`) and the other requests a metadata of their own for
``CPU_ATTN``; then, in every layer, ``CPU_ATTN`` attends the other requests and one call of kvfold's
pool kernel attends all the requests on files (:mod:`kvfold.runtime.pool_attention`): each file's
rows read where they lie, in one running softmax with the request's own tokens (question, answer)
read straight from the blocks vLLM wrote them to, no placeholder slot attended. A request whose blocks
the kernel refuses (they do not hold its file's chunks) is taken out of the step and reported to the
connector as a load error: vLLM ends it with an error, and the engine and the step's other requests go
on. The file's keys keep the positions the context gave them: the question's queries, at served
positions ``P + j``, are turned by ``T − P`` to the positions ``T + j`` they have in ``kvfold ask``
(RoPE logits depend only on the difference of positions). A request that names no file is vLLM's own
attention, at vLLM's bytes.

Which requests are on files: the scheduler side of the connector sends, every step, the blocks that
hold the file of each scheduled request on a file, in the connector metadata vLLM binds to the worker
before the forward; the backend asks the connector (:meth:`KvfoldConnector.active_pools
<kvfold.integrations.vllm.connector.KvfoldConnector.active_pools>`) and finds the requests whose block
table rows begin with those blocks (:func:`requests_on_files`). (vLLM starts a step's connector work
after the forward when the step has no load to wait for, so nothing may be handed over there.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvfold.integrations.vllm.pool_layout import ServedPool
from kvfold.runtime.native import attend_pool_kernel, pool_status
from kvfold.runtime.pool_attention import EngineCaches, PoolStep, StepRequest

__all__ = ["KvfoldAttentionBackend", "KvfoldAttentionImpl", "layer_caches", "requests_on_files"]
logger = logging.getLogger("kvfold.vllm")


def _active_pools() -> dict[tuple[int, ...], ServedPool]:
    """This step's requests on files, by the blocks that hold their file, from the bound connector metadata."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    connector = get_kv_transfer_group()
    active = getattr(connector, "active_pools", None)
    return active() if active is not None else {}


def _report_refused(block_ids: list[int]) -> None:
    """Tell the connector that requests holding these blocks cannot be read as their file (the pool kernel
    refused them, or they were left out of the step's files): it reports the blocks as load errors, and
    vLLM ends the requests."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        fail = getattr(get_kv_transfer_group(), "fail_blocks", None)
        if fail is not None:
            fail(block_ids)


def requests_on_files(
    active: dict[tuple[int, ...], ServedPool], table: torch.Tensor
) -> tuple[list[tuple[int, ServedPool]], list[int]]:
    """The step's requests on files, from the block table ``table`` and the active files by their blocks
    (requests sharing a file's blocks are one entry of ``active``).

    Returns:
        ``(row, pool)`` for each row whose first blocks are those of an active file; and, for each row that
        begins with an active file's first block but not with all its blocks, the first of its blocks that
        differs. Such a row is a request on a file that is not read as one (a block of it did not hold
        its file, or its file could not be had: the connector reported it). A plain request never holds
        a file's block, so it is reported again here, whatever left it out, so that it is never
        answered as a plain request over its file's bytes.
    """
    if not active:
        return [], []
    by_first: dict[int, list[tuple[list[int], ServedPool]]] = {}
    for blocks, served in active.items():
        by_first.setdefault(blocks[0], []).append((list(blocks), served))
    found, stray = [], []
    for row, first in enumerate(table[:, 0].tolist()):
        candidates = by_first.get(first, ())
        for blocks, served in candidates:
            if table[row, : len(blocks)].tolist() == blocks:
                found.append((row, served))
                break
        else:
            if candidates:
                own = table[row, : len(candidates[0][0])].tolist()
                stray.append(next((b for b, c in zip(own, candidates[0][0], strict=False) if b != c), own[-1]))
    return found, stray


def key_positions(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> torch.Tensor:
    """Where ``CPU_ATTN`` puts key element ``(t, c)`` (index ``t · D + c``) in a (block, head)'s run of keys:
    learned once by writing a known pattern with its own cache write (values lie plainly, ``(block_size,
    D)``; keys are packed for the instruction set, ``vec``: channel-major).

    Raises:
        RuntimeError: a layout that is not a permutation within a block.
    """
    from vllm import _custom_ops as ops

    size = block_size * head_dim
    cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    index = torch.arange(size).view(block_size, 1, head_dim)
    found = []
    for part in (index % 128, index // 128):  # exact in every 16-bit dtype
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(
            part.to(dtype), part.to(dtype), key_cache, value_cache, torch.arange(block_size), isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        found.append(cache.view(-1).float().clone())
    where_key = (found[0][:size] + 128 * found[1][:size]).long()
    where_value = (found[0][size:] + 128 * found[1][size:]).long()
    if not torch.equal(torch.sort(where_key).values, torch.arange(size)) or not torch.equal(
        where_value, torch.arange(size)
    ):
        raise RuntimeError(f"CPU_ATTN's cache layout ({isa}) is not a permutation within a block")
    position = torch.empty(size, dtype=torch.long)
    position[where_key] = torch.arange(size)
    return position


def layer_caches(forward_context=None) -> list[torch.Tensor]:
    """Every attention layer's KV cache, in layer order (from this step's forward context)."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.utils import extract_layer_index

    context = forward_context if forward_context is not None else get_forward_context()
    found = {}
    for name, layer in context.no_compile_layers.items():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, torch.Tensor) and cache.numel():
            found[extract_layer_index(name)] = cache
    return [found[i] for i in sorted(found)]


@dataclass
class _Step:
    """What every layer of one step shares: the requests on files as the kernel's table, and the other
    requests as ``CPU_ATTN``'s own (None when there are none; ``rows`` their query rows, a slice when
    they are contiguous)."""

    metadata: object
    pool: PoolStep | None
    plain: object | None
    rows: slice | torch.Tensor | None


class _Shared:
    """State shared by every layer's implementation: the engine's caches (once) and the current step."""

    engine: EngineCaches | None = None
    step: _Step | None = None
    warned = False


class KvfoldAttentionImpl(CPUAttentionBackendImpl):
    """``CPU_ATTN`` for the requests that name no file, kvfold's pool kernel for the others (module
    docstring)."""

    _layer_index: int | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        if attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)  # fmt: skip
        step = self._step(layer, attn_metadata, kv_cache)
        if step.pool is None:  # no request on a file in this step: CPU_ATTN as it is
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)  # fmt: skip
        if step.plain is not None:  # the requests that name no file, alone
            if isinstance(step.rows, slice):
                super().forward(layer, query[step.rows], key, value, kv_cache, step.plain, output[step.rows])
            else:
                part = torch.empty_like(output[: len(step.rows)])
                super().forward(layer, query.index_select(0, step.rows), key, value, kv_cache, step.plain, part)
                output.index_copy_(0, step.rows, part)
        if self._layer_index is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_index = extract_layer_index(layer.layer_name)
        refused = step.pool.attend(self._layer_index, query, output)
        if refused:  # their blocks do not hold their file: they end with an error, the engine goes on
            ends = [int(r.blocks[r.file.placeholders // step.pool.engine.block_size - 1]) for r in refused]
            logger.error("kvfold: the pool kernel refused the requests whose files end in blocks %s (layer %d): "
                         "their blocks do not hold their file; they fail", ends, self._layer_index)  # fmt: skip
            _report_refused(ends)
        return output

    def _step(self, layer, attn_metadata, kv_cache: torch.Tensor) -> _Step:
        """This step's tables, made by the first layer that asks (keyed on vLLM's metadata object, which
        every layer of the step shares)."""
        step = _Shared.step
        if step is not None and step.metadata is attn_metadata:
            return step
        num_reqs = len(attn_metadata.seq_lens)
        on_files, stray = requests_on_files(_active_pools(), attn_metadata.block_table[:num_reqs])
        if stray:  # requests on files not read as such: ended, never answered as plain requests
            _report_refused(stray)
        if not on_files:
            _Shared.step = _Step(attn_metadata, None, None, None)
            return _Shared.step
        engine = self._engine(layer, kv_cache)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        table = attn_metadata.block_table
        if table.dtype != torch.int32:
            table = table.to(torch.int32)
        requests = [
            StepRequest(starts[i], starts[i + 1] - starts[i], seq_lens[i], served.kernel_file, table[i])
            for i, served in on_files
        ]
        pool = PoolStep(engine, requests)  # each request's blocks: a view of the table, alive with the step
        taken = {i for i, _ in on_files}
        plain = [i for i in range(num_reqs) if i not in taken]
        metadata, rows = None, None
        if plain:
            metadata, rows = self._plain_metadata(layer, attn_metadata, plain, starts, seq_lens, kv_cache.dtype)
        _Shared.step = _Step(attn_metadata, pool, metadata, rows)
        return _Shared.step

    def _engine(self, layer, kv_cache: torch.Tensor) -> EngineCaches:
        """The engine's caches as the kernel reads them (made once; again if vLLM gave new caches)."""
        caches = layer_caches()
        engine = _Shared.engine
        if engine is None or [c.data_ptr() for c in engine.caches] != [c.data_ptr() for c in caches]:
            position = key_positions(layer.isa, kv_cache.dtype, kv_cache.shape[2], self.head_size)
            engine = _Shared.engine = EngineCaches(caches, self.num_heads, self.scale, key_position=position)
            if attend_pool_kernel() is None and not _Shared.warned:
                _Shared.warned = True
                logger.warning("kvfold: requests on files take the per-chunk PyTorch path: %s", pool_status())
        return engine

    def _plain_metadata(self, layer, attn_metadata, plain: list[int], starts: list[int], seq_lens: list[int],
                        dtype: torch.dtype):  # fmt: skip
        """``CPU_ATTN``'s metadata for the requests ``plain`` alone, and their query rows."""
        from vllm import _custom_ops as ops
        from vllm import envs

        counts = [starts[i + 1] - starts[i] for i in plain]
        index = torch.tensor(plain, dtype=torch.long)
        query_start_loc = torch.zeros(len(plain) + 1, dtype=attn_metadata.query_start_loc.dtype)
        query_start_loc[1:] = torch.tensor(counts).cumsum(0)
        sub_seq_lens = attn_metadata.seq_lens.index_select(0, index)
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(plain), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            seq_lens=sub_seq_lens, dtype=dtype,
            query_start_loc=query_start_loc, causal=attn_metadata.causal, sliding_window_size=self.sliding_window,
            isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
            kv_cache_dtype=self.kv_cache_dtype,
        )  # fmt: skip
        metadata = replace(
            attn_metadata,
            num_actual_tokens=sum(counts),
            max_query_len=max(counts),
            query_start_loc=query_start_loc,
            max_seq_len=max(seq_lens[i] for i in plain),
            seq_lens=sub_seq_lens,
            block_table=attn_metadata.block_table.index_select(0, index),
            scheduler_metadata=scheduler,
        )
        first, stop = starts[plain[0]], starts[plain[-1] + 1]
        if stop - first == sum(counts):  # contiguous rows: views, no copies
            return metadata, slice(first, stop)
        return metadata, torch.cat([torch.arange(starts[i], starts[i + 1]) for i in plain])


class KvfoldAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` whose implementation is :class:`KvfoldAttentionImpl` (given to the plugin model's
    layers through ``Attention(..., attn_backend=...)``; vLLM's choice for other models is untouched)."""

    @staticmethod
    def get_impl_cls() -> type[KvfoldAttentionImpl]:
        return KvfoldAttentionImpl
