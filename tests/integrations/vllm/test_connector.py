"""The KV connector's bounds, with fake scheduler outputs and a fake forward context (no engine).

* a load allocated but not scheduled in that step is kept until a step schedules its request, and
  dropped when the request finishes;
* a resumed request scheduled without its blocks fails: its blocks, as allocated, are reported as
  load errors (vLLM then ends it with an error);
* a load that does not fit the model's layers or the request's slots fails the same way;
* chunk ``c`` of a file lands in block ``c // L`` of layer ``c % L``, and every scheduled request on a
  file is sent by its first block, and given to the backend from the metadata bound for the step;
* a block that held a file's bytes is zeroed in every layer before a request without a file gets it
  (once), never under a request on a file;
* a block is read as a file's only if the worker's last write to it was a successful load of that file
  at that place: the blocks of a failed load, a zeroed block or one another file's load wrote since fail
  the request that would read them, even once the file is readable again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvfold.integrations.vllm import connector
from kvfold.integrations.vllm.connector import (
    POOLS_KEPT,
    FileRef,
    KvfoldConnector,
    KvfoldConnectorMetadata,
    LoadSpec,
)
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
    meta = conn.build_connector_meta(_output(new={"a": [7, 8, 9]}))
    assert [(ref.name, ref.blocks) for ref in meta.active] == [("doc", (7, 8))]  # not the question's block 9
    assert conn.build_connector_meta(_output(cached=["a"], cached_blocks=[None])).active == meta.active  # running
    assert conn.build_connector_meta(_output()).active == []  # not scheduled this step
    # preempted, then resumed in new blocks: sent by its new first block
    meta = conn.build_connector_meta(_output(cached=["a"], resumed=["a"], cached_blocks=[([11, 12],)]))
    assert [ref.blocks for ref in meta.active] == [(11, 12)]
    conn.request_finished(_request("a"), [11, 12])
    assert conn.build_connector_meta(_output(cached=["a"], cached_blocks=[None])).active == []


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
    def __init__(self, blocks: int = 40, cache: bool = True) -> None:
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


def _ref(first: int, name: str = "doc", checksum: str = "abc", slots: int = SLOTS) -> FileRef:
    """A request's file as the scheduler side sends it, held in blocks ``first, first + 1``."""
    return FileRef(name, checksum, slots, (first, first + 1))


def _spec(ref: FileRef, start: int = 0) -> LoadSpec:
    """The load of ``ref``'s file into its blocks, from slot ``start``."""
    return LoadSpec(req_id=f"r{ref.blocks[0]}", name=ref.name, checksum=ref.checksum, slots=ref.slots, start=start,
                    count=ref.slots - start, block_ids=list(ref.blocks))  # fmt: skip


def _load_ref(conn: KvfoldConnector, ref: FileRef, context: SimpleNamespace, start: int = 0) -> set[int]:
    """A load of ``ref``'s file into its blocks, in a step of its own; the load errors reported."""
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(KvfoldConnectorMetadata(loads=[_spec(ref, start)]))
    conn.start_load_kv(context)
    return conn.get_block_ids_with_load_errors()


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
    ref = _ref(7)
    assert _load_ref(worker, ref, SimpleNamespace(no_compile_layers=_layers())) == set()
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(KvfoldConnectorMetadata(active=[ref, _ref(9, slots=SLOTS + 32)]))
    active = worker.active_pools()
    assert list(active) == [(7, 8)]  # a request whose slots do not match the file is not read as that file
    assert active[(7, 8)].placeholders == SLOTS
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
    conn.context = SimpleNamespace(no_compile_layers=_layers())  # the forward context of its loads
    return conn, write, reads


def _step(conn: KvfoldConnector, refs: list[FileRef], loads: tuple[FileRef, ...] = ()) -> tuple[dict, set[int]]:
    """One step: its requests on files ``refs`` as the backend gets them (by their file blocks), after the
    loads of ``loads`` (the step's new requests), and the load errors reported."""
    conn.clear_connector_metadata()
    meta = KvfoldConnectorMetadata(loads=[_spec(ref) for ref in loads], active=list(refs))
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(conn.context)
    return conn.active_pools(), conn.get_block_ids_with_load_errors()


def test_a_file_replaced_while_a_request_answers_from_it_is_still_the_one_it_loaded(files):
    """The pool of a request in progress stays in memory however many other files its steps read (more
    than the worker keeps), so the file on disk may change under it."""
    conn, write, reads = files
    write("doc", "first")
    answering = _ref(7, checksum="first")
    assert list(_step(conn, [answering], loads=(answering,))[0]) == [(7, 8)]
    write("doc", "second")  # replaced on disk, as a user may
    others = []
    for i in range(POOLS_KEPT + 1):  # other requests, on more files than the worker keeps, in the same steps
        write(f"other{i}", f"c{i}")
        others.append(_ref(20 + 2 * i, f"other{i}", f"c{i}"))
    for step in range(3):
        active, failed = _step(conn, [answering, *others], loads=tuple(others) if step == 0 else ())
        assert sorted(active) == [(7, 8), *(ref.blocks for ref in others)] and failed == set()
    assert reads.count("doc") == 1


def test_a_request_whose_file_is_gone_in_the_middle_of_its_answer_fails(files):
    """Its pool left memory (the request was not scheduled for a while) and the file on disk changed:
    its first block is a load error, so vLLM ends it instead of going on without its file."""
    conn, write, _ = files
    write("doc", "first")
    first = _ref(7, checksum="first")
    assert list(_step(conn, [first], loads=(first,))[0]) == [(7, 8)]
    for i in range(POOLS_KEPT + 1):  # steps without it: its pool is not kept
        write(f"other{i}", f"c{i}")
        other = _ref(20 + 2 * i, f"other{i}", f"c{i}")
        _step(conn, [other], loads=(other,))
    write("doc", "second")
    assert _load_ref(conn, _ref(9, checksum="second"), conn.context) == set()
    active, failed = _step(conn, [_ref(7, checksum="first"), _ref(9, checksum="second")])
    assert list(active) == [(9, 10)] and failed == {8}  # the first request's last file block


def test_a_file_is_kept_by_its_content_under_any_name(files):
    """Two names with one content share blocks (their salt is the checksum); a request on the second,
    replaced on disk since its check, still reads the content its blocks hold."""
    conn, write, reads = files
    write("code", "first")
    write("swap", "second")  # a copy of "code" when it was checked; replaced since
    refs = [_ref(5, "code", "first"), _ref(7, "swap", "first")]
    active, failed = _step(conn, refs, loads=tuple(refs))
    assert sorted(active) == [(5, 6), (7, 8)] and failed == set() and reads == ["code"]


def test_the_blocks_of_a_failed_load_are_not_read_as_the_file_once_it_is_readable_again(files):
    """``swap`` was checked as "first" and replaced by "second" before its load, so the load fails; vLLM
    ends the request only once it has handled the step's errors, and meanwhile schedules it again (or
    gives its blocks, still in the prefix cache, to another request on "first"). By then "first" is back
    on disk: its blocks, never written, must not be read as "first"."""
    conn, write, reads = files
    write("swap", "second")
    request = _ref(7, "swap", "first")
    assert _load_ref(conn, request, conn.context) == {7, 8}
    write("swap", "first")  # restored
    active, failed = _step(conn, [request])
    assert active == {} and failed == {7}
    assert reads == ["swap", "swap"]  # the file is readable: only the blocks tell
    active, failed = _step(conn, [request], loads=(request,))  # loaded again: read as the file
    assert list(active) == [(7, 8)] and failed == set()


def test_a_partial_prefix_hit_whose_load_fails_reports_only_the_blocks_it_was_to_write(files):
    """A request that found the file's first block in the prefix cache (another request answers from it)
    and whose load of the rest failed: only the rest is reported, so vLLM ends it and not the request that
    shares its first block; and it is not read as the file while it is still scheduled."""
    conn, write, _ = files
    write("doc", "first")
    assert _load_ref(conn, _ref(7, checksum="first"), conn.context) == set()
    write("doc", "second")
    for i in range(POOLS_KEPT + 1):  # "first" leaves the worker's memory
        write(f"other{i}", f"c{i}")
        _load_ref(conn, _ref(20 + 2 * i, f"other{i}", f"c{i}"), conn.context)
    sharing = FileRef("doc", "first", SLOTS, (7, 9))  # block 7 from the prefix cache, block 9 to load
    assert _load_ref(conn, sharing, conn.context, start=BLOCK) == {9}
    write("doc", "first")
    active, failed = _step(conn, [_ref(7, checksum="first"), sharing])
    assert list(active) == [(7, 8)]  # the first request ...
    assert failed == {9}  # ... not the second: its block that no load wrote is reported, not the one they share


@pytest.mark.parametrize("how", ["zeroed", "another-file"])
def test_a_block_written_since_its_load_is_no_longer_read_as_the_file(files, monkeypatch, how):
    conn, write, _ = files
    monkeypatch.setattr(connector, "_forward_context", lambda: conn.context)
    write("doc", "first")
    request = _ref(7, checksum="first")
    assert list(_step(conn, [request], loads=(request,))[0]) == [(7, 8)]
    if how == "zeroed":  # given to a request without a file
        conn.bind_connector_metadata(KvfoldConnectorMetadata(scrub=[8]))
    else:
        write("other", "c")
        assert _load_ref(conn, _ref(8, "other", "c"), conn.context) == set()
    active, failed = _step(conn, [request])
    assert active == {} and failed == {8}


def test_a_request_refused_by_the_kernel_fails_and_its_blocks_are_no_longer_the_files(files):
    conn, write, _ = files
    write("doc", "first")
    request = _ref(7, checksum="first")
    assert list(_step(conn, [request], loads=(request,))[0]) == [(7, 8)]
    conn.fail_blocks([8])  # the backend's report: the request's last file block
    assert conn.get_block_ids_with_load_errors() == {8}
    active, failed = _step(conn, [request])
    assert active == {} and failed == {8}
