"""The KV connector that writes a quantized cache file into a request's blocks as its own bytes.

The request's prompt is ``P`` placeholder tokens (the file's blocks × block size,
:attr:`~kvfold.integrations.vllm.pool_layout.ServedPool.placeholders`) then the question. As in
:class:`~kvfold.integrations.vllm.connector.KvfoldConnector`, the scheduler side reports the
placeholders as matched externally, so vLLM allocates their blocks without computing them; the
worker side then copies the file's chunks (:mod:`kvfold.runtime.row_pool`) into those blocks, chunk
``c`` into block ``c // L`` of layer ``c % L``: the request holds ``ceil(file bytes / block bytes)``
blocks for its file, whatever its rows' lengths.

Every step, the scheduler side also sends the first block of each scheduled request on a file, and
the worker side publishes them to the attention backend (:func:`kvfold.integrations.vllm.backend.publish`),
which then reads those requests' files from their blocks. A request preempted and resumed gets new
blocks: its load runs again, and its new first block is sent.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvfold.integrations.vllm.connector import KvfoldConnector, KvfoldConnectorMetadata, LoadSpec
from kvfold.integrations.vllm.requests import KV_KEY, cache_path

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvfold.vllm")

POOLS_KEPT = 4
"""Files whose chunks the worker keeps in memory (the most recently used)."""


@dataclass(frozen=True)
class FileRef:
    """A request's file as the scheduler side knows it."""

    name: str
    checksum: str
    slots: int


@dataclass
class KvfoldPoolMetadata(KvfoldConnectorMetadata):
    """The loads of one step, and the scheduled requests on files by their first block."""

    active: dict[int, FileRef] = field(default_factory=dict)


class KvfoldPoolConnector(KvfoldConnector):
    """Writes quantized cache files into requests' blocks at their bytes (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model_config = self._vllm_config.model_config
        self.dtype = model_config.dtype
        # scheduler side: the requests on files, and their first blocks
        self._files: dict[str, FileRef] = {}
        self._first_block: dict[str, int] = {}
        # worker side: built pools, by file
        self._pools: OrderedDict[tuple[Any, str], tuple[Any, torch.Tensor]] = OrderedDict()

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get(KV_KEY) is not None:
            slots = params.get("kvfold_slots")
            self._files[request.request_id] = FileRef(
                str(params[KV_KEY]), str(params.get("kvfold_checksum")), slots if isinstance(slots, int) else -1
            )
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvfoldPoolMetadata:
        base = super().build_connector_meta(scheduler_output)
        meta = KvfoldPoolMetadata(loads=base.loads)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._files and new.block_ids and new.block_ids[0]:
                self._first_block[new.req_id] = int(new.block_ids[0][0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if req_id in self._files and req_id in cached.resumed_req_ids and blocks and blocks[0]:
                self._first_block[req_id] = int(blocks[0][0])
        scheduled = [new.req_id for new in scheduler_output.scheduled_new_reqs] + list(cached.req_ids)
        for req_id in scheduled:
            if req_id in self._files and req_id in self._first_block:
                meta.active[self._first_block[req_id]] = self._files[req_id]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._files.pop(request.request_id, None)
        self._first_block.pop(request.request_id, None)
        done, params = super().request_finished(request, block_ids)
        if params is not None:
            from kvfold.integrations.vllm.pool_layout import chunk_bytes

            layers = self.hf_config.num_hidden_layers
            params["kvfold_block_bytes"] = chunk_bytes(self.hf_config, self.block_size, self.dtype) * layers
        return done, params

    # ================================================================ worker side
    def _pool(self, name: str, checksum: str):
        """The file as a request holds it and its chunks (kept for the next request on it).

        Raises:
            ValueError: the file is missing, damaged, not quantized, or not the one the request was
                checked against.
        """
        from kvfold.integrations.vllm.pool_layout import served_pool
        from kvfold.store.load import read_cache

        path = cache_path(self.directory, name)
        key = (path, checksum)
        with self._lock:
            if key in self._pools:
                self._pools.move_to_end(key)
                return self._pools[key]
        cache, info = read_cache(path, self.hf_config)
        found = str((info.header.get("checksum") or {}).get("value"))
        if found != checksum:
            raise ValueError(f"{path} changed since the request was checked (checksum {found[:12]}…)")
        pool = served_pool(cache, self.hf_config, self.block_size, self.dtype)
        with self._lock:
            self._pools[key] = pool
            while len(self._pools) > POOLS_KEPT:
                self._pools.popitem(last=False)
        return pool

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        from kvfold.integrations.vllm.backend import publish

        meta = self._get_connector_metadata()
        active = {}
        for first, ref in getattr(meta, "active", {}).items():
            try:
                served, _ = self._pool(ref.name, ref.checksum)
            except (ValueError, OSError) as err:
                logger.error("kvfold cache %r not served: %s", ref.name, err)
                continue
            if served.placeholders == ref.slots:
                active[first] = served
        publish(active)
        super().start_load_kv(forward_context, **kwargs)

    def _load(self, forward_context: ForwardContext, load: LoadSpec) -> None:
        from kvfold.integrations.vllm.backend import layer_caches

        if load.error:
            raise ValueError(load.error)
        served, chunks = self._pool(load.name, load.checksum)
        if served.placeholders != load.slots:
            raise ValueError(f"the file needs {served.placeholders} placeholder slots, the request has {load.slots}")
        caches = layer_caches(forward_context)
        layers = len(served.plan.rows_per_layer)
        if len(caches) != layers:
            raise ValueError(f"the model has {len(caches)} attention layers with a cache, the file {layers}")
        if len(load.block_ids) < served.file_blocks:
            raise ValueError("the request holds fewer blocks than the file's chunks")
        for index in range(served.plan.num_chunks):
            target = caches[index % layers][load.block_ids[index // layers]].view(-1).view(torch.uint8)
            if target.numel() != chunks.shape[1]:
                raise ValueError(f"a block of one layer holds {target.numel()} bytes, a chunk {chunks.shape[1]}")
            target.copy_(chunks[index])
