"""kvfold's attention backend for vLLM's CPU build: a request on a cache file attends the file's rows
where they lie, as the library holds them (codes, scales, β), inside the request's own KV blocks.

A request on a file (:mod:`kvfold.integrations.vllm.pool_connector`) has ``P`` placeholder tokens, ``P``
a whole number of blocks, then the question. Its first ``P / block_size`` blocks, over every layer,
hold the file's chunks (:mod:`kvfold.runtime.row_pool`): chunk ``c`` fills block ``c // L`` of layer
``c % L``. The engine never writes those blocks (their tokens are matched externally) and this backend
never reads them as keys and values.

:class:`KvfoldAttentionImpl` is vLLM's ``CPU_ATTN`` for every request (the same cache layout, the same
kernels, the same cache write), and then, for each request on a file, replaces its rows of the output
with kvfold's attention: the file's rows read by kvfold's kernel, merged by log-sum-exp with the
request's own tokens (question, answer) read back from the blocks vLLM wrote them to. The file's keys
keep the positions the context gave them: the question's queries, at served positions ``P + j``, are
turned by ``T − P`` to the positions ``T + j`` they have in ``kvfold ask`` (RoPE logits depend only on
the difference of positions). A request that names no file is vLLM's own attention, at vLLM's bytes.

Which requests are on files: the scheduler side of the connector sends, every step, the first block of
each scheduled request on a file, in the connector metadata vLLM binds to the worker before the
forward; the backend asks the connector (:meth:`KvfoldConnector.active_pools
<kvfold.integrations.vllm.connector.KvfoldConnector.active_pools>`). A request's first block is its
own while it runs. (vLLM starts a step's connector work after the forward when the step has no load
to wait for, so nothing may be handed over there.)
"""

from __future__ import annotations

import math

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvfold.integrations.vllm.layout import rotate_keys
from kvfold.integrations.vllm.pool_layout import ServedPool
from kvfold.runtime.row_pool import attend_layer

__all__ = ["KvfoldAttentionBackend", "KvfoldAttentionImpl", "layer_caches"]


def _active_pools() -> dict[int, ServedPool]:
    """This step's requests on files, by their first block, from the bound connector metadata."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    connector = get_kv_transfer_group()
    active = getattr(connector, "active_pools", None)
    return active() if active is not None else {}


class _BlockReader:
    """Reads back the keys and values ``CPU_ATTN`` wrote to its blocks. Values lie plainly,
    ``(block_size, D)`` a (block, head); keys are packed for the instruction set (``vec``: channel-major),
    so where each key element lies is learned once by writing a known pattern with the backend's own
    cache write (any permutation within a block's keys is read right)."""

    def __init__(self, isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> None:
        from vllm import _custom_ops as ops

        self.block_size, self.head_dim = block_size, head_dim
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
        self.key_position = torch.empty(size, dtype=torch.long)
        self.key_position[where_key] = torch.arange(size)

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` tokens' keys and values ``(count, H, D)`` in blocks ``blocks``."""
        num_blocks, heads, block_size, _ = kv_cache.shape
        size = block_size * self.head_dim
        runs = kv_cache.index_select(0, blocks).view(len(blocks), heads, 2 * size)
        keys = runs[:, :, :size].index_select(2, self.key_position).view(len(blocks), heads, block_size, -1)
        values = runs[:, :, size:].view(len(blocks), heads, block_size, -1)
        keys = keys.permute(0, 2, 1, 3).reshape(-1, heads, self.head_dim)[:count]
        values = values.permute(0, 2, 1, 3).reshape(-1, heads, values.shape[-1])[:count]
        return keys, values


class _Chunks:
    """The chunks of one request, by index: chunk ``c`` is block ``blocks[c // L]`` of layer ``c % L``,
    read in place as bytes."""

    def __init__(self, caches: list[torch.Tensor], blocks: torch.Tensor) -> None:
        self.caches, self.blocks = caches, blocks.tolist()

    def __getitem__(self, index: int) -> torch.Tensor:
        layers = len(self.caches)
        return self.caches[index % layers][self.blocks[index // layers]].view(-1).view(torch.uint8)


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


class KvfoldAttentionImpl(CPUAttentionBackendImpl):
    """``CPU_ATTN``, with the rows of requests on files recomputed by kvfold (module docstring)."""

    _reader: _BlockReader | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)  # fmt: skip
        if attn_metadata is None:
            return out
        active = _active_pools()
        if not active:
            return out
        files = self._requests_on_files(attn_metadata, active)
        if not files:
            return out
        from vllm.model_executor.models.utils import extract_layer_index

        index = extract_layer_index(layer.layer_name)
        caches = layer_caches()
        if self._reader is None:
            self._reader = _BlockReader(layer.isa, kv_cache.dtype, kv_cache.shape[2], self.head_size)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i, served in files:
            first, stop = starts[i], starts[i + 1]
            blocks = attn_metadata.block_table[i].long()
            output[first:stop] = self._attend_file(
                query[first:stop], kv_cache, blocks, seq_lens[i], served, caches, index
            ).to(output.dtype)
        return output

    @staticmethod
    def _requests_on_files(attn_metadata, active: dict[int, ServedPool]) -> list[tuple[int, ServedPool]]:
        firsts = attn_metadata.block_table[:, 0].tolist()
        num_reqs = len(attn_metadata.seq_lens)
        return [(i, active[firsts[i]]) for i in range(num_reqs) if firsts[i] in active]

    def _attend_file(self, query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                     served: ServedPool, caches: list[torch.Tensor], layer: int) -> torch.Tensor:  # fmt: skip
        """One request's attention in one layer: its file's rows and its own tokens (module docstring)."""
        tokens, heads, dim = query.shape
        kv_heads = self.num_kv_heads
        group = heads // kv_heads
        block_size = kv_cache.shape[2]
        placeholders = served.placeholders
        own = seq_len - placeholders  # the question's and answer's tokens in the cache
        tail_blocks = blocks[placeholders // block_size : math.ceil(seq_len / block_size)]
        keys, values = self._reader.read(kv_cache, tail_blocks, own)  # (own, H, D)
        folded = query.float().view(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
        tail_logits = folded @ keys.float().permute(1, 2, 0) * self.scale  # (H, G·tokens, own)
        token = torch.arange(group * tokens) % tokens
        visible = torch.arange(own)[None, :] <= (own - tokens + token)[:, None]
        tail_logits.masked_fill_(~visible[None], float("-inf"))
        turned = rotate_keys(folded, served.logical_length - placeholders, served.inv_freq)
        chunks = _Chunks(caches, blocks)
        out = attend_layer(turned, tail_logits, values.float().permute(1, 0, 2), chunks, served.plan, layer,
                           self.scale)  # fmt: skip
        return out.view(kv_heads, group, tokens, -1).permute(2, 0, 1, 3).reshape(tokens, heads, -1)


class KvfoldAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` whose implementation is :class:`KvfoldAttentionImpl` (given to the plugin model's
    layers through ``Attention(..., attn_backend=...)``; vLLM's choice for other models is untouched)."""

    @staticmethod
    def get_impl_cls() -> type[KvfoldAttentionImpl]:
        return KvfoldAttentionImpl
