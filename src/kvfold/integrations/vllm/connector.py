"""The KV connector that loads a kvfold cache file into vLLM's paged KV cache.

vLLM loads it from ``kv_transfer_config.kv_connector_module_path`` (set by ``kvfold serve``). A
request whose ``kv_transfer_params`` name a cache (:data:`~kvfold.integrations.vllm.requests.KV_KEY`,
with its checksum and slot count, as :meth:`CacheCatalog.prepare
<kvfold.integrations.vllm.requests.CacheCatalog.prepare>` writes them) has a prompt of ``slots``
placeholder tokens followed by the question. The scheduler side reports those ``slots`` tokens as
matched externally (``get_num_new_matched_tokens``), so vLLM allocates blocks for them without
computing them; the worker side then writes the file's entries into those slots, layer by layer,
with the backend's own cache write (``cpu_attn_reshape_and_cache``), before the forward that
computes the question (a synchronous load).

* Blocks: a request holds ``ceil((slots + question + answer) / block_size)`` blocks, the compressed
  length padded to the longest row, not the context's. ``request_finished`` reports the count in the
  response's ``kv_transfer_params`` (``kvfold_blocks``).
* Prefix caching: the placeholder ids are the same for every cache of one length, so requests are
  salted with their file's checksum (``cache_salt``); a local prefix hit (the same file, asked
  again) loads only the slots past the hit.
* Preemption: a preempted request loses its blocks and starts again from no computed token; the
  scheduler then asks the connector again, and the file is loaded again into the new blocks.
* A load that fails (the file changed or vanished since it was checked, does not match the
  request, or did not reach every layer of the file) reports the request's blocks as failed, and
  vLLM's ``kv_load_failure_policy="fail"`` (``kvfold serve`` sets it) ends that request with an
  error; the engine goes on. So does a resumed request scheduled without its block list: its blocks
  (as allocated) are reported failed instead of its placeholders being computed as text.
* A load is sent to the worker in the step that schedules its request. One allocated but not
  scheduled in that step is kept until a step schedules the request or the request finishes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
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

LAYOUTS_KEPT = 4
"""Laid-out files the worker keeps in memory (the most recently used)."""


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


@dataclass
class KvfoldConnectorMetadata(KVConnectorMetadata):
    """The loads of one step."""

    loads: list[LoadSpec] = field(default_factory=list)


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
        # scheduler side
        self._pending: dict[str, _Pending] = {}
        self._to_load: dict[str, _Pending] = {}
        # worker side
        self._layouts: OrderedDict[tuple[Path, str, bool], Any] = OrderedDict()
        self._failed_blocks: set[int] = set()
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
        return meta

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
        self._pending.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        if params is None:
            return False, None
        return False, {
            KV_KEY: params[KV_KEY],
            "kvfold_slots": params.get("kvfold_slots"),
            "kvfold_blocks": len(block_ids),
            "kvfold_block_size": self.block_size,
        }

    # ================================================================ worker side
    def _layout(self, name: str, checksum: str):
        """The laid-out file (kept for the next request on it).

        Raises:
            ValueError: the file is missing, damaged, or not the one the request was checked against.
        """
        from kvfold.integrations.vllm.layout import build_layout, read_cache_file

        path = cache_path(self.directory, name)
        key = (path, checksum, self.keep_positions)
        with self._lock:
            if key in self._layouts:
                self._layouts.move_to_end(key)
                return self._layouts[key]
        cache, header = read_cache_file(path, self.hf_config)
        found = str((header.get("checksum") or {}).get("value"))
        if found != checksum:
            raise ValueError(f"{path} changed since the request was checked (checksum {found[:12]}…)")
        layout = build_layout(cache, self.hf_config, keep_positions=self.keep_positions)
        with self._lock:
            self._layouts[key] = layout
            while len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        return layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfoldConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            try:
                self._load(forward_context, load)
            except (ValueError, OSError, CacheRequestError, RuntimeError, IndexError) as err:
                logger.error("kvfold cache %r for request %s not loaded: %s", load.name, load.req_id, err)
                with self._lock:
                    self._failed_blocks.update(load.block_ids)

    def _load(self, forward_context: ForwardContext, load: LoadSpec) -> None:
        from vllm import _custom_ops as ops
        from vllm.model_executor.models.utils import extract_layer_index

        if load.error:
            raise ValueError(load.error)
        layout = self._layout(load.name, load.checksum)
        if layout.slots != load.slots:
            raise ValueError(f"the file holds {layout.slots} slots a row, the request {load.slots}")
        positions = torch.arange(load.start, load.start + load.count)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        if int(positions[-1]) // self.block_size >= len(blocks):
            raise ValueError("the request holds fewer blocks than the cache's slots")
        slot_mapping = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        written: set[int] = set()
        for layer_name, layer in forward_context.no_compile_layers.items():
            if not hasattr(layer, "kv_cache"):
                continue  # not an attention layer
            kv_cache = getattr(layer, "kv_cache", None)
            if not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0 or not hasattr(layer, "isa"):
                raise ValueError(f"{layer_name}: an attention layer without a CPU KV cache to write into")
            index = extract_layer_index(layer_name)
            if not 0 <= index < len(layout.keys) or index in written:
                raise ValueError(f"{layer_name}: layer {index} is not one of the file's {len(layout.keys)} layers")
            keys = layout.keys[index][:, load.start : load.start + load.count].transpose(0, 1).contiguous()
            values = layout.values[index][:, load.start : load.start + load.count].transpose(0, 1).contiguous()
            num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
            if keys.shape[1:] != (num_kv_heads, kv_cache.shape[-1] // 2):
                raise ValueError(
                    f"{layer_name}: the file's entries are {tuple(keys.shape[1:])}, the cache's "
                    f"{(num_kv_heads, kv_cache.shape[-1] // 2)}"
                )
            key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                keys.to(kv_cache.dtype),
                values.to(kv_cache.dtype),
                key_cache,
                value_cache,
                slot_mapping.to(kv_cache.device),
                layer.isa,
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=layer.impl.kv_cache_dtype,
            )
            written.add(index)
        if len(written) != len(layout.keys):
            raise ValueError(f"{len(written)} of the file's {len(layout.keys)} layers were written")

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
