"""A serving step's requests on pooled cache files, attended in the engine's blocks: one call a layer.

An engine (vLLM's CPU build, :mod:`kvfold.integrations.vllm.backend`) holds every layer's KV cache as
blocks, ``(num_blocks, kv_heads, block_size, 2 · D)``: per (block, head) ``block_size`` keys, in a layout
of the engine's (:class:`EngineCaches`), then as many values. A request on a cache file holds, first, the
file's chunks (:mod:`kvfold.runtime.row_pool`: chunk ``c`` is block ``blocks[c // L]`` of layer ``c % L``),
then its own tokens (question, answer), written there by the engine at slots ``P, P + 1, …``.

What is made when:

* **once per file** (:func:`pooled_file`): where each row's segments lie in the chunks (chunk, entries,
  byte offsets of codes, scales, zero points and β), grouped by layer and KV head, and the cos/sin of
  the turn of the queries by the file's position offset ``T − P`` (RoPE logits depend only on the
  difference of positions, so the question's queries at served positions ``P + j`` are turned to
  ``T + j``, where ``kvfold ask`` puts them);
* **once per engine** (:class:`EngineCaches`): every layer's cache address, the key layout, a
  workspace for each thread;
* **once per step** (:class:`PoolStep`): a table of the step's requests on files (query rows, length,
  block table row, file);
* **per layer**: one call of the compiled kernel (:func:`kvfold.runtime.native.attend_pool_kernel`)
  for all of them, whatever the number of requests, chunks and segments. It reads every segment where
  it lies (codes and fp16 scales in place, nothing dequantized), keeps one running softmax across a
  row's segments and the request's own tokens (causal among the new ones), and writes the output rows
  in place.

:func:`attend_request_per_chunk` computes the same for one request in PyTorch, chunk by chunk
(:func:`~kvfold.runtime.row_pool.attend_layer`, the path the kernel replaced): the tests' reference,
and the path taken when no C compiler builds the kernel (``kvfold serve`` says so when it starts).

Nothing here imports vLLM.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvfold.runtime.native import ERRORS, REQUEST_REFUSED, PoolKernel, attend_pool_kernel
from kvfold.runtime.row_pool import ChunkLayout, PoolError, PoolPlan, attend_layer, chunk_rows
from kvfold.runtime.value_rotation import value_rotation

__all__ = [
    "EngineCaches",
    "PoolStep",
    "PooledFile",
    "StepRequest",
    "attend_request_per_chunk",
    "check_chunks",
    "pooled_file",
    "segment_table",
    "turn",
    "turn_table",
]

SEGMENT_FIELDS = ("chunk", "entries", "keys", "values", "key_scale", "key_zero", "value_scale", "value_zero", "beta")
"""A segment's row in :func:`segment_table`: its chunk, entries, then the byte offsets in the chunk of its
key codes (or keys at full precision), value codes (values), key scales, key zero points, value scales,
value zero points and β (−1 where the chunk holds none)."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The kernel's codes for the engine's and full-precision rows' dtypes."""
KEYS_CHANNEL_MAJOR, KEYS_TABLE = 0, 1


# ------------------------------------------------------------------------------------------ positions
def turn_table(inv_freq: Tensor, shift: int) -> Tensor:
    """``(D/2, 2)`` float64: cos and sin of RoPE's angle for a move of ``shift`` positions, per rotated
    pair (``inv_freq``: the angle per position of each pair)."""
    angle = shift * inv_freq.to(torch.float64)
    return torch.stack([torch.cos(angle), torch.sin(angle)], -1).contiguous()


def turn(x: Tensor, table: Tensor) -> Tensor:
    """Keys or queries ``(..., D)`` (RoPE's half-split layout) rotated by the angles of ``table``
    (:func:`turn_table`), in float64; returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    cos, sin = table[:, 0], table[:, 1]
    wide = x.to(torch.float64)
    x1, x2 = wide[..., :half], wide[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ------------------------------------------------------------------------------------------ the structures
class KernelFile(ctypes.Structure):
    """``kvf_file`` of ``kernels/attend_pool.c``."""

    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in ("layers", "rows", "num_chunks", "chunk_bytes", "num_segments", "bits", "float_dtype")
        ],
        *[(name, ctypes.c_int64) for name in ("group", "dim", "vdim", "flags", "placeholders")],
        *[(name, ctypes.c_void_p) for name in ("row_start", "segments", "chunk_segments", "rope", "value_rotation")],
    ]


class KernelRequest(ctypes.Structure):
    """``kvf_request`` of ``kernels/attend_pool.c``."""

    _fields_ = [
        ("query_start", ctypes.c_int64),
        ("query_len", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("file", ctypes.c_void_p),
        ("blocks", ctypes.c_void_p),
        ("num_block_ids", ctypes.c_int64),
    ]


class KernelEngine(ctypes.Structure):
    """``kvf_engine`` of ``kernels/attend_pool.c``."""

    _fields_ = [
        ("layers", ctypes.c_int64),
        ("layer_cache", ctypes.c_void_p),
        *[
            (name, ctypes.c_int64)
            for name in ("num_blocks", "kv_heads", "q_heads", "block_size", "dim", "dtype", "key_layout")
        ],
        ("key_position", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_floats", ctypes.c_int64),
    ]


# ------------------------------------------------------------------------------------------ once per file
def segment_table(plan: PoolPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Where every row's segments lie, for the kernel.

    Returns:
        ``row_start`` ``(L · R + 1,)``: row ``(layer, head)``'s segments are ``segments[row_start[i] :
        row_start[i + 1]]``, ``i = layer · R + head``, in the order of the row's entries;
        ``segments`` ``(S, 9)`` int64, one row per segment (:data:`SEGMENT_FIELDS`);
        ``chunk_segments`` ``(chunks,)``: the segments each chunk's header counts.
    """
    rows = plan.rows_per_layer
    if len(set(rows)) > 1:
        raise ValueError("every layer of a served pool has the same rows (batch × KV heads)")
    per_layer = rows[0] if rows else 0
    records: list[tuple[int, int, list[int]]] = []
    for index, chunk in enumerate(plan.chunks):
        records += [(seg.layer, seg.row, offsets) for seg, offsets in _chunk_offsets(index, chunk, plan)]
    segments = torch.tensor([r[2] for r in records], dtype=torch.int64).reshape(-1, len(SEGMENT_FIELDS))
    owners = torch.tensor([layer * per_layer + row for layer, row, _ in records], dtype=torch.int64)
    if owners.numel() > 1 and bool((owners[1:] < owners[:-1]).any()):
        raise ValueError("a pool plan's segments are not in row order")
    counts = torch.bincount(owners, minlength=len(rows) * per_layer)
    row_start = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    chunk_segments = torch.tensor([len(c.segments) for c in plan.chunks], dtype=torch.int64)
    return row_start, segments.contiguous(), chunk_segments


def _chunk_offsets(index: int, chunk: ChunkLayout, plan: PoolPlan):
    """Each segment of a chunk with its row of :func:`segment_table`."""
    offsets = chunk.offsets
    beta = offsets["log_mass"][0] if plan.beta else -1
    entry = group = 0
    for seg in chunk.segments:
        n = seg.entries
        if plan.config is None:
            size = torch.empty(0, dtype=plan.dtype).element_size()
            record = [index, n, offsets["keys"][0] + entry * plan.head_dim * size]
            record += [offsets["values"][0] + entry * plan.value_dim * size, -1, -1, -1, -1]
        else:
            bits, dim = plan.config.bits, plan.head_dim
            record = [index, n, offsets["key_codes"][0] + entry * (dim * bits // 8)]
            record += [offsets["value_codes"][0] + entry * (plan.value_dim * bits // 8)]
            record += [offsets["key_scale"][0] + group * dim * 2, offsets["key_zero"][0] + group * dim * 2]
            record += [offsets["value_scale"][0] + entry * 2, offsets["value_zero"][0] + entry * 2]
            group += math.ceil(n / plan.config.key_group)
        record.append(beta + entry * 4 if plan.beta else -1)
        entry += n
        yield seg, record


@dataclass(frozen=True, eq=False)
class PooledFile:
    """A pooled file as the kernel reads it (:func:`pooled_file`; made once per file).

    Attributes:
        plan: where its rows lie in the chunks.
        placeholders: P, the served slots its chunks take (whole blocks).
        turn: ``(D/2, 2)`` float64, cos and sin of the queries' turn by ``T − P``.
        row_start, segments, chunk_segments: :func:`segment_table`.
        struct: the kernel's ``kvf_file``, pointing into the tensors above.
        rotation: ``(Dv, Dv)`` float32, the matrix the file's values were rotated by
            (:mod:`kvfold.runtime.value_rotation`), or None.
    """

    plan: PoolPlan
    placeholders: int
    turn: Tensor
    row_start: Tensor
    segments: Tensor
    chunk_segments: Tensor
    struct: KernelFile = field(repr=False)
    rotation: Tensor | None = None


def pooled_file(plan: PoolPlan, placeholders: int, shift: int, inv_freq: Tensor) -> PooledFile:
    """The kernel's tables for a pooled file whose request takes ``placeholders`` slots, its queries
    turned by ``shift`` positions (``T − P``) with RoPE frequencies ``inv_freq``."""
    row_start, segments, chunk_segments = segment_table(plan)
    table = turn_table(inv_freq, shift)
    bits = 0 if plan.config is None else plan.config.bits
    rotation = value_rotation(plan.value_dim).contiguous() if plan.config is not None and plan.config.rotate else None
    struct = KernelFile(
        layers=len(plan.rows_per_layer),
        rows=plan.rows_per_layer[0] if plan.rows_per_layer else 0,
        num_chunks=plan.num_chunks,
        chunk_bytes=plan.chunk_bytes,
        num_segments=segments.shape[0],
        bits=bits,
        float_dtype=DTYPE_CODES.get(plan.dtype, -1),
        group=0 if plan.config is None else plan.config.key_group,
        dim=plan.head_dim,
        vdim=plan.value_dim,
        flags=plan.flags,
        placeholders=placeholders,
        row_start=row_start.data_ptr(),
        segments=segments.data_ptr(),
        chunk_segments=chunk_segments.data_ptr(),
        rope=table.data_ptr(),
        value_rotation=None if rotation is None else rotation.data_ptr(),
    )
    return PooledFile(plan, placeholders, table, row_start, segments, chunk_segments, struct, rotation)


# ------------------------------------------------------------------------------------------ once per engine
class EngineCaches:
    """The engine's KV caches as the kernel reads them.

    Args:
        caches: every attention layer's cache, ``(num_blocks, kv_heads, block_size, 2 · D)``, contiguous,
            in the engine's dtype (float32, bfloat16 or float16).
        q_heads: query heads (a multiple of the KV heads).
        scale: the logit scale.
        key_position: ``(block_size · D,)``: where key element ``(t, c)`` (index ``t · D + c``) lies in a
            (block, head)'s run of keys; None for channel-major (``c · block_size + t``).
        threads: threads for the kernel (default: torch's).
    """

    def __init__(
        self,
        caches: Sequence[Tensor],
        q_heads: int,
        scale: float,
        key_position: Tensor | None = None,
        threads: int | None = None,
    ) -> None:
        if not caches:
            raise ValueError("no layer caches")
        first = caches[0]
        if first.dtype not in DTYPE_CODES:
            raise ValueError(f"the engine's cache dtype {first.dtype} is not read by the pool kernel")
        for cache in caches:
            if cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous():
                raise ValueError("every layer's cache must be contiguous, of one shape and dtype")
        num_blocks, kv_heads, block_size, width = first.shape
        self.caches = list(caches)
        self.num_blocks, self.kv_heads, self.block_size, self.dim = num_blocks, kv_heads, block_size, width // 2
        self.q_heads, self.scale, self.dtype = q_heads, float(scale), first.dtype
        channel_major = (torch.arange(self.dim)[None, :] * block_size + torch.arange(block_size)[:, None]).reshape(-1)
        if key_position is None:
            key_position = channel_major
        self.key_position = key_position.to(torch.int32).contiguous()
        self.layout = KEYS_CHANNEL_MAJOR if torch.equal(key_position.long(), channel_major) else KEYS_TABLE
        self.addresses = torch.tensor([c.data_ptr() for c in self.caches], dtype=torch.int64)
        self.threads = max(1, threads if threads is not None else torch.get_num_threads())
        self._struct: KernelEngine | None = None
        self._kernel: PoolKernel | None = None

    @property
    def layers(self) -> int:
        return len(self.caches)

    def struct(self, kernel: PoolKernel) -> KernelEngine:
        """The kernel's ``kvf_engine`` (made once, with each thread's workspace)."""
        if self._struct is None or self._kernel is not kernel:
            per_thread = kernel.workspace_floats(self.dim)
            self.workspace = torch.empty(self.threads * per_thread, dtype=torch.float32)
            self._struct = KernelEngine(
                layers=self.layers,
                layer_cache=self.addresses.data_ptr(),
                num_blocks=self.num_blocks,
                kv_heads=self.kv_heads,
                q_heads=self.q_heads,
                block_size=self.block_size,
                dim=self.dim,
                dtype=DTYPE_CODES[self.dtype],
                key_layout=self.layout,
                key_position=self.key_position.data_ptr(),
                scale=self.scale,
                threads=self.threads,
                workspace=self.workspace.data_ptr(),
                workspace_floats=self.workspace.numel(),
            )
            self._kernel = kernel
        return self._struct

    def chunk(self, blocks: Tensor, index: int, layers: int) -> Tensor:
        """Chunk ``index`` of a request whose block table row is ``blocks``, as bytes (a view)."""
        return self.caches[index % layers][int(blocks[index // layers])].view(-1).view(torch.uint8)

    def own_tokens(self, blocks: Tensor, layer: int, first_slot: int, count: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``(count, kv_heads, D)`` of slots ``first_slot …`` of a request in one layer's
        cache (its own tokens), read back from its blocks ``blocks`` (its block table row)."""
        size = self.block_size * self.dim
        first_block = first_slot // self.block_size
        wanted = blocks[first_block : math.ceil((first_slot + count) / self.block_size)].long()
        runs = self.caches[layer].index_select(0, wanted).view(len(wanted), self.kv_heads, 2 * size)
        keys = runs[:, :, :size].index_select(2, self.key_position.long())
        keys = keys.view(len(wanted), self.kv_heads, -1, self.dim)
        values = runs[:, :, size:].view(len(wanted), self.kv_heads, -1, self.dim)
        skip = first_slot - first_block * self.block_size
        keys = keys.permute(0, 2, 1, 3).reshape(-1, self.kv_heads, self.dim)[skip : skip + count]
        values = values.permute(0, 2, 1, 3).reshape(-1, self.kv_heads, self.dim)[skip : skip + count]
        return keys, values


# ------------------------------------------------------------------------------------------ once per step
@dataclass(frozen=True)
class StepRequest:
    """A request on a file in a step.

    Attributes:
        query_start: its first row in the step's query and output.
        query_len: its rows (the step's new tokens of it).
        seq_len: its tokens in the engine's cache after this step (P placeholders, then its own).
        file: its pooled file.
        blocks: ``(n,)`` int32, its block table row (a view; it must outlive the step).
    """

    query_start: int
    query_len: int
    seq_len: int
    file: PooledFile
    blocks: Tensor


class PoolStep:
    """A step's requests on files, as the kernel reads them (made once per step), and the call per layer.

    A request the kernel refuses (:data:`~kvfold.runtime.native.REQUEST_REFUSED`: its blocks do not hold
    its file's chunks, or its rows, blocks or file do not fit the engine) is taken out of the step: its
    output rows are zeroed in this layer and every later one (finite, whatever the engine's buffer held),
    the other requests are attended, and :meth:`attend` returns it, so that the caller ends that request
    with an error rather than the whole engine stopping. The per-chunk path
    refuses a request whose chunk headers are not its file's the same way.

    Attributes:
        refused: the requests taken out so far, in the order they were refused.
    """

    def __init__(self, engine: EngineCaches, requests: Sequence[StepRequest], kernel: PoolKernel | None = None):
        self.engine = engine
        self.requests = list(requests)
        self.refused: list[StepRequest] = []
        self.kernel = kernel if kernel is not None else attend_pool_kernel()
        for request in self.requests:
            if request.blocks.dtype != torch.int32 or request.blocks.stride(-1) != 1:
                raise ValueError("a request's block table row must be a contiguous int32 tensor")
        self._table = _kernel_table(self.requests)

    @property
    def native(self) -> bool:
        """Whether the compiled kernel runs (else the per-chunk PyTorch path)."""
        return self.kernel is not None

    def attend(self, layer: int, query: Tensor, output: Tensor) -> list[StepRequest]:
        """Write every request's rows of ``output`` ``(tokens, q_heads, D)`` for ``layer``: one kernel call.

        Args:
            layer: the layer's index.
            query: ``(tokens, q_heads, D)`` the step's queries (rotated at their served positions), in the
                engine's dtype, its last dimension contiguous.
            output: like ``query``; only the requests' rows are written.

        Returns:
            The requests refused in this call (class docstring): their rows are zeros, here and in the
            step's later layers, where they are not attended. Empty when every request was attended.

        Raises:
            RuntimeError: the kernel refused the call itself (an engine layout or size it does not read).
        """
        self._zero_refused(output)
        if not self.requests:
            return []
        if self.kernel is None:
            done, refused = [], []
            for request in self.requests:
                rows = _rows(request)
                try:
                    done.append((rows, attend_request_per_chunk(self.engine, request, layer, query[rows])))
                except PoolError:
                    refused.append(request)
            refused = self._refuse(refused, output)
            for rows, out in done:
                output[rows] = out.to(output.dtype)
            return refused
        engine = self.engine
        dtypes_fit = query.dtype == engine.dtype and output.dtype == engine.dtype
        if not dtypes_fit or query.stride(-1) != 1 or output.stride(-1) != 1:
            raise ValueError("the query and output must be in the engine's dtype, their last dimension contiguous")
        code = self._call(self._table, len(self.requests), layer, query, output)
        if code != REQUEST_REFUSED:
            _raise_for(code)
            return []
        refused = []  # nothing was written: each request alone says which do not fit
        for request in self.requests:
            code = self._call(_kernel_table([request]), 1, layer, query, output)
            if code == REQUEST_REFUSED:
                refused.append(request)
            else:
                _raise_for(code)
        refused = self._refuse(refused, output)
        if self.requests:  # again without them, after their rows were zeroed (whatever rows they claimed)
            _raise_for(self._call(self._table, len(self.requests), layer, query, output))
        return refused

    def tiles(self) -> list[list[int]] | None:
        """The kernel's tiles for this step's requests: for each, the indices (in :attr:`requests`) of the
        requests whose queries it attends together. Requests that hold one file in the same blocks share a
        tile (one pass over the file's rows for all their queries, up to 64 queries a KV head, fewer when
        the call's threads need more tiles to share out). None without the kernel."""
        if self.kernel is None:
            return None
        engine = ctypes.byref(self.engine.struct(self.kernel))
        return self.kernel.tiles(engine, self._table, len(self.requests))

    def _call(self, table, count: int, layer: int, query: Tensor, output: Tensor) -> int:
        return self.kernel.attend(
            ctypes.byref(self.engine.struct(self.kernel)), table, count, layer, query.shape[0],
            query.data_ptr(), query.stride(0), query.stride(1), output.data_ptr(), output.stride(0), output.stride(1),
        )  # fmt: skip

    def _refuse(self, refused: list[StepRequest], output: Tensor) -> list[StepRequest]:
        """Take ``refused`` out of the step and zero the rows of every request taken out."""
        if not refused:
            return []
        gone = {id(request) for request in refused}
        self.requests = [request for request in self.requests if id(request) not in gone]
        self._table = _kernel_table(self.requests)
        self.refused.extend(refused)
        self._zero_refused(output)
        return refused

    def _zero_refused(self, output: Tensor) -> None:
        for request in self.refused:
            output[_rows(request)] = 0


def _kernel_table(requests: Sequence[StepRequest]) -> ctypes.Array:
    """The kernel's table of ``requests``."""
    return (KernelRequest * len(requests))(
        *[
            KernelRequest(
                query_start=r.query_start,
                query_len=r.query_len,
                seq_len=r.seq_len,
                file=ctypes.addressof(r.file.struct),
                blocks=r.blocks.data_ptr(),
                num_block_ids=r.blocks.numel(),
            )
            for r in requests
        ]
    )


def _rows(request: StepRequest) -> slice:
    """A request's rows of the step's query and output (clipped at 0: a refused request's may not fit)."""
    start = max(request.query_start, 0)
    return slice(start, max(request.query_start + request.query_len, start))


def _raise_for(code: int) -> None:
    """Nothing for 0; else the kernel's refusal as a RuntimeError."""
    if code:
        why = ERRORS.get(code, "unknown")
        raise RuntimeError(f"the pool-attention kernel refused its arguments (code {code}: {why})")


# ------------------------------------------------------------------------------------------ the reference
def attend_request_per_chunk(engine: EngineCaches, request: StepRequest, layer: int, query: Tensor) -> Tensor:
    """One request's rows of one layer's attention, chunk by chunk in PyTorch (float32).

    The file's rows are read by :func:`~kvfold.runtime.row_pool.attend_layer` (each chunk's segments by
    :func:`~kvfold.runtime.quantized_attention.stored_part`, merged by log-sum-exp) with the queries
    turned by the file's offset, and merged with the request's own tokens read back from the blocks.

    Args:
        engine: the engine's caches.
        request: the request.
        layer: the layer.
        query: ``(tokens, q_heads, D)``: the request's rows of the step's queries.

    Returns:
        ``(tokens, q_heads, D)`` float32.
    """
    file = request.file
    tokens, heads, dim = query.shape
    kv_heads = engine.kv_heads
    group = heads // kv_heads
    own = request.seq_len - file.placeholders
    keys, values = engine.own_tokens(request.blocks, layer, file.placeholders, own)  # (own, H, D)
    folded = query.float().view(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    tail_logits = folded @ keys.float().permute(1, 2, 0) * engine.scale  # (H, G · tokens, own)
    token = torch.arange(group * tokens) % tokens
    visible = torch.arange(own)[None, :] <= (own - tokens + token)[:, None]
    tail_logits.masked_fill_(~visible[None], float("-inf"))
    chunks = [engine.chunk(request.blocks, c, engine.layers) for c in range(file.plan.num_chunks)]
    turned = turn(folded, file.turn)
    out = attend_layer(turned, tail_logits, values.float().permute(1, 0, 2), chunks, file.plan, layer, engine.scale)
    return out.view(kv_heads, group, tokens, -1).permute(2, 0, 1, 3).reshape(tokens, heads, -1)


def check_chunks(engine: EngineCaches, file: PooledFile, blocks: Tensor) -> None:
    """Check every chunk's header in a request's blocks against the file's plan (after a load).

    Raises:
        kvfold.runtime.row_pool.PoolError: a chunk that is not the plan's.
    """
    layers = engine.layers
    for index, layout in enumerate(file.plan.chunks):
        chunk_rows(engine.chunk(blocks, index, layers), layout, file.plan, 0, 0)
