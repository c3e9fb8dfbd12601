"""The KV connector's bounds, with fake scheduler outputs and a fake forward context (no engine).

* a load allocated but not scheduled in that step is kept until a step schedules its request, and
  dropped when the request finishes;
* a resumed request scheduled without its blocks fails: its blocks, as allocated, are reported as
  load errors (vLLM then ends it with an error);
* a load that does not fit the model's layers or the request's slots fails the same way;
* chunk ``c`` of a file lands in block ``c // L`` of layer ``c % L``, and every scheduled request on a
  file is sent by its first block, and given to the backend from the metadata bound for the step;
* a block that held a file's bytes is zeroed in every layer before a request without a file gets it
  (once), never under a request on a file.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvfold.integrations.vllm import connector
from kvfold.integrations.vllm.connector import FileRef, KvfoldConnector, KvfoldConnectorMetadata, LoadSpec
from kvfold.integrations.vllm.settings import EXTRA_CACHES, EXTRA_SHIFT

BLOCK = 32
LAYERS, HEADS, WIDTH, SLOTS = 3, 2, 8, 40


def _connector(tmp_path, role: KVConnectorRole) -> KvfoldConnector:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={EXTRA_CACHES: str(tmp_path), EXTRA_SHIFT: True}),
        cache_config=SimpleNamespace(block_size=BLOCK),
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=WIDTH
            )
        ),
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


def test_every_scheduled_request_on_a_file_is_sent_by_its_first_block(tmp_path):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [7, 8])
    meta = conn.build_connector_meta(_output(new={"a": [7, 8]}))
    assert {first: ref.name for first, ref in meta.active.items()} == {7: "doc"}
    assert conn.build_connector_meta(_output(cached=["a"], cached_blocks=[None])).active.keys() == {7}  # still running
    assert conn.build_connector_meta(_output()).active == {}  # not scheduled this step
    # preempted, then resumed in new blocks: sent by its new first block
    meta = conn.build_connector_meta(_output(cached=["a"], resumed=["a"], cached_blocks=[([11, 12],)]))
    assert meta.active.keys() == {11}
    conn.request_finished(_request("a"), [11, 12])
    assert conn.build_connector_meta(_output(cached=["a"], cached_blocks=[None])).active == {}


def test_a_block_that_held_a_file_is_scrubbed_once_before_a_request_without_a_file_gets_it(tmp_path):
    conn = _connector(tmp_path, KVConnectorRole.SCHEDULER)
    _allocate(conn, "a", [7, 8])
    assert conn.build_connector_meta(_output(new={"a": [7, 8]})).scrub == []  # the load's own step
    conn.request_finished(_request("a"), [7, 8])
    _allocate(conn, "b", [7, 9])  # another request on a file: its blocks may be the file's, prefix cached
    assert conn.build_connector_meta(_output(new={"b": [7, 9]})).scrub == []
    meta = conn.build_connector_meta(_output(new={"plain": [8, 3]}))  # 8 held the file's bytes
    assert meta.scrub == [8]
    assert conn.build_connector_meta(_output(new={"plain2": [8]})).scrub == []  # zeroed once is enough
    meta = conn.build_connector_meta(_output(cached=["plain", "b"], cached_blocks=[([7],), ([12],)]))
    assert meta.scrub == [7]  # a running request without a file grows into a block that held the file


class _Layer:
    def __init__(self, blocks: int = 4, cache: bool = True) -> None:
        self.kv_cache = torch.zeros(blocks, HEADS, BLOCK, 2 * WIDTH) if cache else torch.tensor([])


CHUNK = HEADS * BLOCK * 2 * WIDTH * 4
CHUNKS = 2 * LAYERS - 1


def _pool() -> tuple[SimpleNamespace, torch.Tensor]:
    """A file of :data:`CHUNKS` chunks, chunk ``c`` all bytes ``c + 1``."""
    served = SimpleNamespace(
        placeholders=SLOTS,
        file_blocks=2,
        plan=SimpleNamespace(rows_per_layer=(HEADS,) * LAYERS, num_chunks=CHUNKS),
    )
    chunks = torch.arange(1, CHUNKS + 1, dtype=torch.uint8)[:, None].expand(CHUNKS, CHUNK).contiguous()
    return served, chunks


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker-side connector whose file is :func:`_pool`."""
    conn = _connector(tmp_path, KVConnectorRole.WORKER)
    monkeypatch.setattr(conn, "_pool", lambda name, checksum: _pool())
    return conn


def _load(conn: KvfoldConnector, layers: dict, slots: int = SLOTS) -> set[int]:
    spec = LoadSpec(req_id="a", name="doc", checksum="abc", slots=slots, start=0, count=slots, block_ids=[2, 3])
    conn.bind_connector_metadata(KvfoldConnectorMetadata(loads=[spec]))
    conn.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    return conn.get_block_ids_with_load_errors()


def _layers(count: int = LAYERS, **bad) -> dict:
    return {f"model.layers.{i}.self_attn.attn": bad.get(str(i), _Layer()) for i in range(count)}


def test_chunk_c_is_written_to_block_c_over_layers_of_layer_c_mod_layers(worker):
    layers = _layers()
    assert _load(worker, {"model.norm": torch.nn.Identity(), **layers}) == set()
    caches = [layer.kv_cache for layer in layers.values()]
    for index in range(CHUNKS):
        block = caches[index % LAYERS][[2, 3][index // LAYERS]]
        assert bool((block.view(-1).view(torch.uint8) == index + 1).all()), index
    assert float(caches[LAYERS - 1][3].abs().sum()) == 0  # past the last chunk: untouched
    assert all(float(cache[[0, 1]].abs().sum()) == 0 for cache in caches)  # other blocks: untouched


def test_the_requests_on_files_are_given_to_the_backend_from_the_bound_metadata(worker):
    assert worker.active_pools() == {}  # no metadata bound
    ref = FileRef("doc", "abc", SLOTS)
    worker.bind_connector_metadata(KvfoldConnectorMetadata(active={7: ref, 9: FileRef("doc", "abc", SLOTS + 32)}))
    active = worker.active_pools()
    assert list(active) == [7]  # a request whose slots do not match the file is not read as that file
    assert active[7].placeholders == SLOTS
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(KvfoldConnectorMetadata())
    assert worker.active_pools() == {}  # the next step's metadata, not the last one's


def test_the_worker_zeroes_the_blocks_to_scrub_in_every_layer_when_the_step_is_bound(worker, monkeypatch):
    layers = _layers()
    context = SimpleNamespace(no_compile_layers=layers)
    monkeypatch.setattr(connector, "_forward_context", lambda: context)
    caches = [layer.kv_cache for layer in layers.values()]
    for cache in caches:
        cache.fill_(float("nan"))
    spec = LoadSpec(req_id="a", name="doc", checksum="abc", slots=SLOTS, start=0, count=SLOTS, block_ids=[2, 3])
    worker.bind_connector_metadata(KvfoldConnectorMetadata(loads=[spec], scrub=[1, 2]))
    # bound before the forward; start_load_kv may come after it (vLLM: on a step without a load)
    for cache in caches:
        assert float(cache[1].abs().sum()) == 0  # zeroed
        assert bool(cache[0].isnan().all())  # not named: untouched
    worker.start_load_kv(context)
    assert bool((caches[0][2].view(-1).view(torch.uint8) == 1).all())  # the load comes after the scrub


@pytest.mark.parametrize("case", ["a-layer-missing", "a-layer-without-cache", "a-layer-the-file-lacks", "slots"])
def test_a_load_that_does_not_fit_the_model_or_the_request_fails(worker, case):
    slots = SLOTS
    if case == "a-layer-missing":
        layers = _layers(LAYERS - 1)
    elif case == "a-layer-without-cache":
        layers = _layers(**{"1": _Layer(cache=False)})
    elif case == "slots":
        layers, slots = _layers(), SLOTS + 32
    else:
        layers = _layers(LAYERS + 1)
    assert _load(worker, layers, slots) == {2, 3}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A worker-side connector over real files ``docN.kvc`` in ``tmp_path`` whose text is their checksum
    (read and laid out by fakes): ``write(name, checksum)`` replaces one."""
    from kvfold.integrations.vllm import layout, pool_layout

    reads: list[str] = []

    def read(path, config):
        reads.append(path.stem)
        return None, {"checksum": {"value": path.read_text()}}

    monkeypatch.setattr(layout, "read_cache_file", read)
    monkeypatch.setattr(pool_layout, "served_pool", lambda cache, config, block, dtype: _pool())

    def write(name: str, checksum: str) -> None:
        (tmp_path / f"{name}.kvc").write_text(checksum)

    conn = _connector(tmp_path, KVConnectorRole.WORKER)
    return conn, write, reads


def _step(conn: KvfoldConnector, active: dict[int, FileRef]) -> tuple[dict, set[int]]:
    """One step's requests on files as the backend gets them, and the load errors reported."""
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(KvfoldConnectorMetadata(active=active))
    return conn.active_pools(), conn.get_block_ids_with_load_errors()


def test_a_file_replaced_while_a_request_answers_from_it_is_still_the_one_it_loaded(files):
    """The pool of a request in progress stays in memory however many other files its steps read (more
    than the worker keeps), so the file on disk may change under it."""
    from kvfold.integrations.vllm.connector import POOLS_KEPT

    conn, write, reads = files
    write("doc", "first")
    answering = {7: FileRef("doc", "first", SLOTS)}
    assert list(_step(conn, answering)[0]) == [7]
    write("doc", "second")  # replaced on disk, as a user may
    others = {}
    for i in range(POOLS_KEPT + 1):  # other requests, on more files than the worker keeps, in the same steps
        write(f"other{i}", f"c{i}")
        others[20 + i] = FileRef(f"other{i}", f"c{i}", SLOTS)
    for _ in range(3):
        active, failed = _step(conn, {**answering, **others})
        assert sorted(active) == [7, *others] and failed == set()
    assert reads.count("doc") == 1


def test_a_request_whose_file_is_gone_in_the_middle_of_its_answer_fails(files):
    """Its pool left memory (the request was not scheduled for a while) and the file on disk changed:
    its first block is a load error, so vLLM ends it instead of going on without its file."""
    from kvfold.integrations.vllm.connector import POOLS_KEPT

    conn, write, _ = files
    write("doc", "first")
    assert list(_step(conn, {7: FileRef("doc", "first", SLOTS)})[0]) == [7]
    for i in range(POOLS_KEPT + 1):  # steps without it: its pool is not kept
        write(f"other{i}", f"c{i}")
        _step(conn, {20 + i: FileRef(f"other{i}", f"c{i}", SLOTS)})
    write("doc", "second")
    active, failed = _step(conn, {7: FileRef("doc", "first", SLOTS), 9: FileRef("doc", "second", SLOTS)})
    assert list(active) == [9] and failed == {7}


def test_a_file_is_kept_by_its_content_under_any_name(files):
    """Two names with one content share blocks (their salt is the checksum); a request on the second,
    replaced on disk since its check, still reads the content its blocks hold."""
    conn, write, reads = files
    write("code", "first")
    write("swap", "second")  # a copy of "code" when it was checked; replaced since
    active, failed = _step(conn, {5: FileRef("code", "first", SLOTS), 7: FileRef("swap", "first", SLOTS)})
    assert sorted(active) == [5, 7] and failed == set() and reads == ["code"]
