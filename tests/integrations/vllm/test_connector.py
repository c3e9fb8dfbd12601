"""The KV connector's bounds, with fake scheduler outputs and a fake forward context (no engine).

* a load allocated but not scheduled in that step is kept until a step schedules its request, and
  dropped when the request finishes;
* a resumed request scheduled without its blocks fails: its blocks, as allocated, are reported as
  load errors (vLLM then ends it with an error);
* a load that does not write every layer of the file fails the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvfold.integrations.vllm.connector import KvfoldConnector, KvfoldConnectorMetadata, LoadSpec
from kvfold.integrations.vllm.settings import EXTRA_CACHES, EXTRA_SHIFT

BLOCK = 32
LAYERS, HEADS, WIDTH, SLOTS = 3, 2, 8, 40


def _connector(tmp_path, role: KVConnectorRole) -> KvfoldConnector:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={EXTRA_CACHES: str(tmp_path), EXTRA_SHIFT: True}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        model_config=SimpleNamespace(hf_config=SimpleNamespace()),
    )
    return KvfoldConnector(config, role)


def _request(req_id: str, slots: int = SLOTS, prompt: int = SLOTS + 10) -> SimpleNamespace:
    params = {"kvfold_cache": "doc", "kvfold_checksum": "abc", "kvfold_slots": slots}
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=prompt)


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self, allow_none: bool = False):
        return (list(self.ids),)


def _output(new: dict[str, list[int]] | None = None, cached=(), resumed=(), cached_blocks=()) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in (new or {}).items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(resumed), new_block_ids=list(cached_blocks)
        ),
    )


def _allocate(conn: KvfoldConnector, req_id: str, blocks: list[int]) -> None:
    request = _request(req_id)
    assert conn.get_num_new_matched_tokens(request, 0) == (SLOTS, False)
    conn.update_state_after_alloc(request, _Blocks(blocks), SLOTS)


def test_a_load_not_scheduled_in_its_step_is_kept_until_it_is(tmp_path):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [7, 8])
    assert conn.build_connector_meta(_output()).loads == []  # not scheduled this step: kept
    loads = conn.build_connector_meta(_output(new={"a": [7, 8]})).loads
    assert [(x.req_id, x.start, x.count, x.block_ids, x.error) for x in loads] == [("a", 0, SLOTS, [7, 8], None)]
    assert conn.build_connector_meta(_output(new={"a": [7, 8]})).loads == []  # sent once


def test_a_finished_request_drops_its_kept_load(tmp_path):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [7, 8])
    conn.build_connector_meta(_output())
    conn.request_finished(_request("a"), [7, 8])
    assert conn.build_connector_meta(_output(new={"a": [7, 8]})).loads == []


@pytest.mark.parametrize("case", ["not-resumed", "no-block-list"])
def test_a_resumed_request_without_its_blocks_fails(tmp_path, case):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [4, 5])
    if case == "not-resumed":
        output = _output(cached=["a"], resumed=[], cached_blocks=[([9],)])
    else:
        output = _output(cached=["a"], resumed=["a"], cached_blocks=[None])
    (load,) = conn.build_connector_meta(output).loads
    assert load.block_ids == [4, 5] and load.error and "without the request's blocks" in load.error

    worker = _connector(tmp_path, KVConnectorRole.WORKER)
    worker.bind_connector_metadata(KvfoldConnectorMetadata(loads=[load]))
    worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
    assert worker.get_block_ids_with_load_errors() == {4, 5}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once


def test_a_resumed_request_with_its_blocks_loads_into_the_new_ones(tmp_path):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [4, 5])
    (load,) = conn.build_connector_meta(_output(cached=["a"], resumed=["a"], cached_blocks=[([11, 12],)])).loads
    assert load.block_ids == [11, 12] and load.error is None


class _Layer:
    def __init__(self, blocks: int = 4, cache: bool = True) -> None:
        self.kv_cache = torch.zeros(blocks, HEADS, BLOCK, 2 * WIDTH) if cache else torch.tensor([])
        self.isa = "vec"
        self._k_scale_float = self._v_scale_float = 1.0
        self.impl = SimpleNamespace(kv_cache_dtype="auto")


def _layout() -> SimpleNamespace:
    keys = [torch.full((HEADS, SLOTS, WIDTH), float(i + 1)) for i in range(LAYERS)]
    return SimpleNamespace(slots=SLOTS, keys=keys, values=[k.clone() for k in keys])


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker-side connector whose file is :func:`_layout` and whose cache write is recorded."""
    from vllm import _custom_ops

    conn = _connector(tmp_path, KVConnectorRole.WORKER)
    monkeypatch.setattr(conn, "_layout", lambda name, checksum: _layout())
    written: list[float] = []

    def write(keys, values, key_cache, value_cache, slot_mapping, isa, **kw):
        written.append(float(keys[0, 0, 0]))

    monkeypatch.setattr(_custom_ops, "cpu_attn_reshape_and_cache", write, raising=False)
    return conn, written


def _load(worker: tuple[KvfoldConnector, list[float]], layers: dict) -> set[int]:
    conn = worker[0]
    spec = LoadSpec(req_id="a", name="doc", checksum="abc", slots=SLOTS, start=0, count=SLOTS, block_ids=[2, 3])
    conn.bind_connector_metadata(KvfoldConnectorMetadata(loads=[spec]))
    conn.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    return conn.get_block_ids_with_load_errors()


def _layers(count: int = LAYERS, **bad) -> dict:
    return {f"model.layers.{i}.self_attn.attn": bad.get(str(i), _Layer()) for i in range(count)}


def test_every_layer_of_the_file_is_written(worker):
    assert _load(worker, {"model.norm": torch.nn.Identity(), **_layers()}) == set()
    assert worker[1] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "case", ["a-layer-missing", "a-layer-without-cache", "a-layer-without-isa", "a-layer-the-file-lacks"]
)
def test_a_load_that_misses_a_layer_fails(worker, case):
    if case == "a-layer-missing":
        layers = _layers(LAYERS - 1)
    elif case == "a-layer-without-cache":
        layers = _layers(**{"1": _Layer(cache=False)})
    elif case == "a-layer-without-isa":
        layer = _Layer()
        del layer.isa
        layers = _layers(**{"1": layer})
    else:
        layers = _layers(LAYERS + 1)
    assert _load(worker, layers) == {2, 3}
