"""The KV connector that writes a kvfold cache file into a request's blocks, at the file's bytes.

vLLM loads it from ``kv_transfer_config.kv_connector_module_path`` (set by ``kvfold serve``). A
request whose ``kv_transfer_params`` name a cache (:data:`~kvfold.integrations.vllm.requests.KV_KEY`,
with its checksum and slot count, as :meth:`CacheCatalog.prepare
<kvfold.integrations.vllm.requests.CacheCatalog.prepare>` writes them) has a prompt of ``slots``
placeholder tokens followed by the question: ``slots`` is the file's blocks × block size
(:attr:`~kvfold.integrations.vllm.pool_layout.ServedPool.placeholders`). The scheduler side reports
those tokens as matched externally (``get_num_new_matched_tokens``), so vLLM allocates their blocks
without computing them; the worker side then copies the file's chunks (:mod:`kvfold.runtime.row_pool`:
codes, scales, zero points, β, row lengths, as the library holds them) into those blocks, chunk ``c``
into block ``c // L`` of layer ``c % L``, before the forward that computes the question (a
synchronous load). kvfold's attention backend (:mod:`kvfold.integrations.vllm.backend`) reads them there.

* Blocks: a request holds ``ceil(file bytes / block bytes over every layer)`` blocks for its file,
  plus its question's and answer's. ``request_finished`` reports vLLM's count in the response's
  ``kv_transfer_params`` (``kvfold_blocks``) with ``kvfold_block_bytes``, the bytes one block holds
  over every layer.
* Every step, the scheduler side sends each scheduled request on a file with the blocks that hold
  its file (:class:`FileRef`); the backend asks the worker side for them
  (:meth:`KvfoldConnector.active_pools`, by those blocks) during the forward, finds each request by
  its block table row and recomputes those requests' attention. Requests that share the file's blocks
  (the prefix cache) are one entry.
* Prefix caching: the placeholder ids are the same for every file of one size, so requests are
  salted with their file's checksum (``cache_salt``); a local prefix hit (the same file, asked
  again) shares the blocks that hold it.
* Preemption: a preempted request loses its blocks and starts again from no computed token; the
  scheduler then asks the connector again, the file is written again into the new blocks, and the
  new blocks are sent.
* A load that fails (the file changed or vanished since it was checked, does not match the
  request, or the model's layers do not match the file's) reports the blocks it was to write as
  failed, and vLLM's ``kv_load_failure_policy="fail"`` (``kvfold serve`` sets it) ends that request
  with an error; the engine goes on. So does a resumed request scheduled without its block list: its
  blocks (as allocated) are reported failed instead of its placeholders being computed as text.
* A block is read as a file's only if this worker's last write to it was a successful load of that
  file at that place: the worker remembers what each load wrote (with the file's checksum), and a
  request with a block that no load of its file wrote fails, that block reported
  (:meth:`KvfoldConnector.missing_block`). Until vLLM has handled a failed load's errors, its blocks
  stay in the prefix cache under the file's salt, and the request itself (scheduled again before
  those errors are handled) or another on the same file could be given them. A request the pool
  kernel refuses fails the same way, its last file block reported (:meth:`KvfoldConnector.fail_blocks`).
  A reported block ends every request that holds it among its computed blocks, so the block chosen is
  one that only requests reading the same bytes share.
* A load is sent to the worker in the step that schedules its request. One allocated but not
  scheduled in that step is kept until a step schedules the request or the request finishes.
* A block that held a file's bytes is zeroed before a request that names no file gets it. The bytes
  are codes and scales, and read as the engine's floats some are NaN or near the largest float;
  ``CPU_ATTN`` computes a request's last block whole and masks the slots past its length afterwards,
  so a NaN there made every output of that request NaN (found by ``benchmarks/serve_vllm.py``: plain
  requests answered token 0 after 24 requests on files had filled the KV space). The scheduler side
  remembers the blocks it sent loads into and sends, every step, those among the new blocks of
  requests without a file (``scrub``); the worker zeroes them in every layer when the step's metadata
  is bound, before the forward writes anything (not in ``start_load_kv``: vLLM calls it after the
  forward on a step without a load). A request on a file never reads past its own tokens, and its cached blocks are
  never zeroed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvfold.integrations.vllm.requests import KV_KEY, CacheRequestError, cache_path
from kvfold.integrations.vllm.settings import EXTRA_CACHES, EXTRA_SHIFT

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvfold.vllm")

POOLS_KEPT = 4
"""Files whose chunks the worker keeps in memory (the most recently used)."""


@dataclass
class LoadSpec:
    """One request's load this step: ``count`` entries from slot ``start`` of file ``name``."""

    req_id: str
    name: str
    checksum: str
    slots: int
    start: int
    count: int
    block_ids: list[int]
    error: str | None = None


@dataclass(frozen=True)
class FileRef:
    """A request's file as the scheduler side knows it: name, checksum, placeholder slots and, once
    allocated, the request's blocks that hold the file (``blocks``, its first ``slots / block_size``)."""

    name: str
    checksum: str
    slots: int
    blocks: tuple[int, ...] = ()


@dataclass
class KvfoldConnectorMetadata(KVConnectorMetadata):
    """The loads of one step, its scheduled requests on files (with their file blocks), and the blocks
    to zero before the step (they held a file's bytes and now belong to a request without a file)."""

    loads: list[LoadSpec] = field(default_factory=list)
    active: list[FileRef] = field(default_factory=list)
    scrub: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    """A request's load as the scheduler side knows it: the file, the slots to write and, once
    allocated, the request's blocks (``block_ids``, used to fail it when a step omits them)."""

    name: str
    checksum: str
    slots: int
    start: int
    count: int = 0
    error: str | None = None
    block_ids: list[int] = field(default_factory=list)


def _first_group(block_ids: Any) -> list[int]:
    """The block ids of the first (only) KV cache group, from vLLM's tuple of per-group lists."""
    if not block_ids:
        return []
    return [int(b) for b in block_ids[0]]


def _forward_context() -> ForwardContext:
    """The step's forward context (vLLM binds a step's connector metadata inside it)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context()


def _request_params(request: Request) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and params.get(KV_KEY) is not None:
        return params
    return None


class KvfoldConnector(KVConnectorBase_V1):
    """Loads kvfold cache files into vLLM's paged KV cache (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get(EXTRA_CACHES):
            raise ValueError(f"KvfoldConnector needs kv_connector_extra_config[{EXTRA_CACHES!r}], the caches' folder")
        self.directory = Path(extra[EXTRA_CACHES])
        self.keep_positions = bool(extra.get(EXTRA_SHIFT, True))
        self.block_size = vllm_config.cache_config.block_size
        self.hf_config = vllm_config.model_config.hf_config
        self.dtype = getattr(vllm_config.model_config, "dtype", torch.float32)
        # scheduler side
        self._pending: dict[str, _Pending] = {}
        self._to_load: dict[str, _Pending] = {}
        self._files: dict[str, FileRef] = {}  # every request on a file, until it finishes
        self._file_blocks: set[int] = set()  # blocks a load was sent into, not zeroed since
        # worker side
        self._pools: OrderedDict[tuple[str, bool], Any] = OrderedDict()  # by checksum: a file's content
        self._active_for: KVConnectorMetadata | None = None  # the metadata self._active was built for
        self._active: dict[int, Any] = {}
        self._pinned: set[tuple[str, bool]] = set()  # the pools of the bound step's requests
        self._failed_blocks: set[int] = set()
        self._held: dict[int, tuple[str, int]] = {}  # block -> (checksum, index among the file's blocks) loaded
        self._lock = threading.Lock()

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _request_params(request)
        if params is None:
            return 0, False
        slots = params.get("kvfold_slots")
        pending = _Pending(name=str(params[KV_KEY]), checksum=str(params.get("kvfold_checksum")), slots=0, start=0)
        if not isinstance(slots, int) or not 0 < slots < request.num_prompt_tokens:
            # Not a prompt CacheCatalog.prepare made: claim the prompt and fail its load, so that vLLM ends the
            # request with an error instead of computing the placeholders as text.
            pending.error = f"kvfold_slots {slots!r} does not fit a prompt of {request.num_prompt_tokens} tokens"
            slots = request.num_prompt_tokens - 1
        pending.slots = slots
        self._pending[request.request_id] = pending
        self._files[request.request_id] = FileRef(pending.name, pending.checksum, slots)
        return max(0, slots - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        pending.start = pending.slots - num_external_tokens
        pending.count = num_external_tokens
        pending.block_ids = _first_group(blocks.get_block_ids(allow_none=True))
        self._to_load[request.request_id] = pending

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads: one for each request with a load to do that the step schedules.

        A resumed request scheduled without its block list gets a load that fails (its blocks, as
        allocated, are reported failed, and vLLM ends it with an error). A load whose request this
        step does not schedule is kept for a later step (it goes when the request finishes).
        """
        meta = KvfoldConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._to_load.pop(new.req_id, None)
            if pending is not None:
                meta.loads.append(self._load_spec(new.req_id, pending, _first_group(new.block_ids)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            pending = self._to_load.pop(req_id, None)
            if pending is None:
                continue
            block_ids = cached.new_block_ids[i]
            if req_id not in cached.resumed_req_ids or block_ids is None:
                logger.error("request %s: kvfold load scheduled without its blocks; the request fails", req_id)
                pending.error = "the load was scheduled without the request's blocks"
                meta.loads.append(self._load_spec(req_id, pending, list(pending.block_ids)))
                continue
            meta.loads.append(self._load_spec(req_id, pending, _first_group(block_ids)))
        for req_id in self._to_load:
            logger.warning("request %s: kvfold load allocated but not scheduled; kept for a later step", req_id)
        self._pending.clear()
        self._publish_files(scheduler_output, meta)
        meta.scrub = self._blocks_to_scrub(scheduler_output)
        for load in meta.loads:  # written this step, after the scrub
            self._file_blocks.update(load.block_ids)
        return meta

    def _blocks_to_scrub(self, scheduler_output: SchedulerOutput) -> list[int]:
        """The new blocks of this step's requests without a file that held a file's bytes (module
        docstring). A request on a file is left alone: its blocks may be the file's, from the prefix
        cache, and it reads only its own tokens past them."""
        if not self._file_blocks:
            return []
        fresh = [b for new in scheduler_output.scheduled_new_reqs if new.req_id not in self._files
                 for b in _first_group(new.block_ids)]  # fmt: skip
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._files and cached.new_block_ids[i] is not None:
                fresh.extend(_first_group(cached.new_block_ids[i]))
        scrub = sorted({b for b in fresh if b in self._file_blocks})
        self._file_blocks.difference_update(scrub)
        return scrub

    def _publish_files(self, scheduler_output: SchedulerOutput, meta: KvfoldConnectorMetadata) -> None:
        """Record the file blocks of each request on a file (new, or resumed with new blocks) and send the
        requests this step schedules."""
        for new in scheduler_output.scheduled_new_reqs:
            self._place(new.req_id, _first_group(new.block_ids))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self._place(req_id, _first_group(cached.new_block_ids[i]))
        for req_id in [new.req_id for new in scheduler_output.scheduled_new_reqs] + list(cached.req_ids):
            ref = self._files.get(req_id)
            if ref is not None and ref.blocks and ref not in meta.active:
                meta.active.append(ref)

    def _place(self, req_id: str, blocks: list[int]) -> None:
        """Record where a request on a file holds it (its first blocks, as allocated or as resumed)."""
        ref = self._files.get(req_id)
        if ref is None or not blocks:
            return
        self._files[req_id] = replace(ref, blocks=tuple(blocks[: -(-ref.slots // self.block_size)]))

    @staticmethod
    def _load_spec(req_id: str, pending: _Pending, block_ids: list[int]) -> LoadSpec:
        return LoadSpec(
            req_id=req_id,
            name=pending.name,
            checksum=pending.checksum,
            slots=pending.slots,
            start=pending.start,
            count=pending.count,
            block_ids=block_ids,
            error=pending.error,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = _request_params(request)
        for kept in (self._pending, self._to_load, self._files):
            kept.pop(request.request_id, None)
        if params is None:
            return False, None
        return False, {
            KV_KEY: params[KV_KEY],
            "kvfold_slots": params.get("kvfold_slots"),
            "kvfold_blocks": len(block_ids),
            "kvfold_block_size": self.block_size,
            "kvfold_block_bytes": self._block_bytes(),
        }

    def _block_bytes(self) -> int:
        """Bytes one block holds over every layer: vLLM's own (its KV cache tensors' bytes over its block
        count), else the same from the model's config."""
        config = getattr(self, "_kv_cache_config", None)
        if config is not None and getattr(config, "num_blocks", 0) and getattr(config, "kv_cache_tensors", None):
            return sum(int(t.size) for t in config.kv_cache_tensors) // int(config.num_blocks)
        from kvfold.integrations.vllm.pool_layout import chunk_bytes

        return chunk_bytes(self.hf_config, self.block_size, self.dtype) * int(self.hf_config.num_hidden_layers)

    # ================================================================ worker side
    def _pool(self, name: str, checksum: str):
        """The file as a request holds it and its chunks' bytes, kept by checksum for the next request on
        the same content (under any name: requests share blocks by their checksum salt, so a request on a
        file replaced since reads the content its blocks hold).

        Raises:
            ValueError: the file is missing, damaged, not the one the request was checked against, or
                not servable.
        """
        from kvfold.integrations.vllm.layout import read_cache_file
        from kvfold.integrations.vllm.pool_layout import served_pool

        key = (checksum, self.keep_positions)  # by content: requests share blocks by checksum (their salt)
        with self._lock:
            if key in self._pools:
                self._pools.move_to_end(key)
                return self._pools[key]
        path = cache_path(self.directory, name)
        cache, header = read_cache_file(path, self.hf_config)
        found = str((header.get("checksum") or {}).get("value"))
        if found != checksum:
            raise ValueError(f"{path} changed since the request was checked (checksum {found[:12]}…)")
        served, chunks = served_pool(cache, self.hf_config, self.block_size, self.dtype)
        if not self.keep_positions:  # the queries stay at the served positions (a test's mutation)
            served = replace(served, logical_length=served.placeholders)
        with self._lock:
            self._pools[key] = (served, chunks)
            spare = [kept for kept in self._pools if kept not in self._pinned and kept != key]
            for kept in spare[: max(0, len(self._pools) - POOLS_KEPT)]:
                del self._pools[kept]
        return served, chunks

    def _pin(self, meta: KvfoldConnectorMetadata) -> None:
        """Keep the pools of the requests ``meta`` schedules (the bound step's) from being evicted: a
        request answering from a file reads it every step, and the file on disk may have been replaced
        since its load."""
        keys = {(ref.checksum, self.keep_positions) for ref in meta.active}
        with self._lock:
            self._pinned = keys

    def active_pools(self) -> dict[tuple[int, ...], Any]:
        """The requests on files of the step whose metadata is bound, by the blocks that hold their file: each
        one's :class:`~kvfold.integrations.vllm.pool_layout.ServedPool`.

        A request is left out, and a block of it reported as a load error so that vLLM ends it with an
        error instead of its answer going on without its file, when:

        * its file cannot be had (no longer the one it was checked against, after its pool left the
          worker's memory) or its placeholders differ from the file's: its last file block is reported;
        * a block of it was not written by a load of its file at that place (:meth:`missing_block`): that
          block is reported. A load that failed leaves its blocks in vLLM's prefix cache until the step's
          errors are handled, and a request sharing them, or the request itself in the next step (vLLM
          schedules a step before it has handled the last one's output), would read whatever they held.
        """
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KvfoldConnectorMetadata):
            return {}
        with self._lock:
            if self._active_for is meta:
                return self._active
        self._pin(meta)
        active, lost = {}, set()
        for ref in meta.active:
            if not ref.blocks:
                continue
            try:
                served, _ = self._pool(ref.name, ref.checksum)
            except (ValueError, OSError, CacheRequestError) as err:
                logger.error("kvfold cache %r not served: %s", ref.name, err)
                lost.add(ref.blocks[-1])
                continue
            if served.placeholders != ref.slots:
                lost.add(ref.blocks[-1])
            elif (missing := self.missing_block(ref)) is not None:
                logger.error("kvfold cache %r not served: block %d of the request does not hold it (its load failed)",
                             ref.name, missing)  # fmt: skip
                lost.add(missing)
            else:
                active[ref.blocks] = served
        if lost:  # read as plain tokens its answer would be garbage: vLLM ends the request instead
            with self._lock:
                self._failed_blocks.update(lost)
        with self._lock:
            self._active_for, self._active = meta, active
        return active

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfoldConnectorMetadata):
            return
        self._pin(meta)
        for load in meta.loads:
            try:
                self._load(forward_context, load)
            except (ValueError, OSError, CacheRequestError, RuntimeError, IndexError) as err:
                logger.error("kvfold cache %r for request %s not loaded: %s", load.name, load.req_id, err)
                # the blocks it was to write (those before hold the file from the prefix cache, maybe for
                # other requests too: reported, they would end those as well)
                stale = load.block_ids[load.start // self.block_size :] or load.block_ids
                self._forget(stale)
                with self._lock:
                    self._failed_blocks.update(stale)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata, and zero its blocks to scrub (module docstring): vLLM binds it
        before the forward, in the step's forward context."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvfoldConnectorMetadata) and connector_metadata.scrub:
            self._forget(connector_metadata.scrub)
            self._scrub(_forward_context(), connector_metadata.scrub)

    def missing_block(self, ref: FileRef) -> int | None:
        """The first of a request's file blocks (``ref.blocks``) that this worker's last write to was not a
        successful load of its file at that place (or that was zeroed since); None when every one holds it."""
        with self._lock:
            for index, block in enumerate(ref.blocks):
                if self._held.get(block) != (ref.checksum, index):
                    return block
        return None

    def fail_blocks(self, block_ids: list[int]) -> None:
        """Report these blocks as failed loads, so that vLLM ends the requests that hold them with an error
        (the backend's pool kernel refused those requests: their blocks do not hold their file); they are
        no longer taken for any file's until a load writes them again."""
        self._forget(block_ids)
        with self._lock:
            self._failed_blocks.update(block_ids)

    def _forget(self, block_ids: list[int]) -> None:
        with self._lock:
            for block in block_ids:
                self._held.pop(block, None)

    @staticmethod
    def _scrub(forward_context: ForwardContext, block_ids: list[int]) -> None:
        """Zero blocks ``block_ids`` in every layer (they held a file's bytes; module docstring)."""
        from kvfold.integrations.vllm.backend import layer_caches

        index = torch.tensor(block_ids, dtype=torch.long)
        for cache in layer_caches(forward_context):
            cache.index_fill_(0, index, 0)

    def _load(self, forward_context: ForwardContext, load: LoadSpec) -> None:
        """Copy the file's chunks into the request's first blocks, over every layer."""
        from kvfold.integrations.vllm.backend import layer_caches

        if load.error:
            raise ValueError(load.error)
        served, chunks = self._pool(load.name, load.checksum)
        if served.placeholders != load.slots:
            raise ValueError(f"the file takes {served.placeholders} placeholder slots, the request {load.slots}")
        caches = layer_caches(forward_context)
        layers = len(served.plan.rows_per_layer)
        if len(caches) != layers:
            raise ValueError(f"the model has {len(caches)} attention layers with a KV cache, the file {layers}")
        if len(load.block_ids) < served.file_blocks:
            raise ValueError("the request holds fewer blocks than the file's chunks")
        for layer, cache in enumerate(caches):  # chunk c lies in layer c mod layers, block c div layers
            blocks = cache.view(cache.shape[0], -1).view(torch.uint8)
            if blocks.shape[1] != chunks.shape[1]:
                raise ValueError(f"a block of one layer holds {blocks.shape[1]} bytes, a chunk {chunks.shape[1]}")
            own = chunks[layer::layers]
            blocks.numpy()[load.block_ids[: own.shape[0]]] = own.numpy()  # a copy a block (torch's is per byte)
        written = {block: (load.checksum, i) for i, block in enumerate(load.block_ids[: served.file_blocks])}
        with self._lock:
            self._held.update(written)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed
