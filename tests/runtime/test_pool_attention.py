"""A serving step's requests on pooled files in one kernel call a layer (kvfold.runtime.pool_attention):
equal to the per-chunk path it replaced for every code width and rows at full precision, with ragged
rows, segments cut inside a key group, several files and requests of different lengths in one step; one
call a layer whatever the requests, chunks and segments; every argument that does not fit refused before
anything is read (release build) or at the read (debug build)."""

from __future__ import annotations

import math
import platform
import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch

from kvfold.runtime import native
from kvfold.runtime.pool_attention import (
    EngineCaches,
    PoolStep,
    StepRequest,
    attend_request_per_chunk,
    check_chunks,
    pooled_file,
    turn,
    turn_table,
)
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.row_pool import FloatRows, PoolError, chunk_rows, pack_pool

D, KV_HEADS, Q_HEADS, LAYERS, BLOCK = 32, 3, 9, 4, 8
SCALE = D**-0.5
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
pytestmark = pytest.mark.skipif(native.attend_pool_kernel() is None, reason=f"no pool kernel: {native.pool_status()}")


def _inv_freq(dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _rows(
    fmt: str | None, lengths: list[int], g: torch.Generator, dtype: torch.dtype, dim: int = D
) -> QuantizedRows | FloatRows:
    width = max(max(lengths), 1)
    keys = torch.randn(KV_HEADS, width, dim, generator=g) * 2
    keys[:, :, 3] += 5.0
    values = torch.randn(KV_HEADS, width, dim, generator=g)
    beta = torch.randn(KV_HEADS, width, generator=g)
    if fmt is None:
        beta[torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]] = float("-inf")
        return FloatRows.from_padded(keys.to(dtype), values.to(dtype), beta)
    return QuantizedRows.from_padded(keys, values, beta, torch.tensor(lengths), QuantConfig.parse(fmt))


@dataclass
class Scene:
    engine: EngineCaches
    requests: list[StepRequest]
    query: torch.Tensor
    tokens: int


def _scene(
    fmt: str | None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    key_layout: str = "channel",
    block: int = BLOCK,
    dim: int = D,
    q_heads: int = Q_HEADS,
) -> Scene:
    """Two files, three requests on them (a question's first step of 5 tokens, a decode step, a 40-token
    question longer than one tile), plain rows between, in an engine of ``block``-token blocks (8 by
    default: rows cut into many segments)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 160
    caches = [torch.randn(num_blocks, KV_HEADS, block, 2 * dim, generator=g).to(dtype) for _ in range(LAYERS)]
    position = None
    if key_layout == "table":  # a permutation of each block's keys other than channel-major
        position = torch.randperm(block * dim, generator=g)
    engine = EngineCaches(caches, q_heads, dim**-0.5, key_position=position, threads=2)
    row_dtype = dtype if fmt is None else torch.float32
    files = []
    ragged = [[70, 0, 33], [5, 90, 64], [0, 0, 0], [41, 1, 77]], [[12, 30, 9], [64, 65, 66], [3, 0, 50], [7, 8, 9]]
    for lengths in ragged:
        layers = [_rows(fmt, row, g, row_dtype, dim) for row in lengths]
        plan, chunks = pack_pool(layers, KV_HEADS * block * 2 * dim * caches[0].element_size())
        placeholders = math.ceil(plan.num_chunks / LAYERS) * block
        files.append((pooled_file(plan, placeholders, 1000 + placeholders, _inv_freq(dim)), chunks))
    free = torch.randperm(num_blocks, generator=g).tolist()
    requests, rows, step = [], 0, []
    for file_index, own, new in ((0, 5, 5), (1, 23, 1), (0, 47, 40)):
        file, chunks = files[file_index]
        seq_len = file.placeholders + own
        blocks = torch.zeros(20, dtype=torch.int32)  # a block table row, wider than the request needs
        held = [free.pop() for _ in range(math.ceil(seq_len / block))]
        blocks[: len(held)] = torch.tensor(held, dtype=torch.int32)
        for c in range(file.plan.num_chunks):
            engine.chunk(blocks, c, LAYERS).copy_(chunks[c])
        rows += 2  # plain rows before each request
        requests.append(StepRequest(rows, new, seq_len, file, blocks))
        rows += new
        step.append(file)
    query = torch.randn(rows + 3, q_heads, dim, generator=g).to(dtype)
    return Scene(engine, requests, query, rows + 3)


def _reference(scene: Scene, layer: int) -> list[torch.Tensor]:
    out = []
    for request in scene.requests:
        rows = slice(request.query_start, request.query_start + request.query_len)
        out.append(attend_request_per_chunk(scene.engine, request, layer, scene.query[rows]))
    return out


def _assert_equals_the_per_chunk_path(scene: Scene, layers) -> None:
    """One call a layer (float32 engine) gives each request's rows what the per-chunk path gives them."""
    step = PoolStep(scene.engine, scene.requests)
    for layer in layers:
        output = torch.full_like(scene.query, float("nan"))
        step.attend(layer, scene.query, output)
        for request, expected in zip(scene.requests, _reference(scene, layer), strict=True):
            got = output[request.query_start : request.query_start + request.query_len]
            torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


FORMATS = ["int8", "int4", "int3", "int2", "int4[key_group=16]", "int3[rotate=1]", None]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f or "full-precision")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_one_call_a_layer_equals_the_per_chunk_path(fmt, dtype):
    scene = _scene(fmt, dtype)
    cut_inside = [
        seg
        for r in scene.requests
        for chunk in r.file.plan.chunks
        for seg in chunk.segments
        if fmt and seg.first % QuantConfig.parse(fmt).key_group
    ]
    assert fmt is None or cut_inside  # some segment starts inside a key group
    step = PoolStep(scene.engine, scene.requests)
    for layer in range(LAYERS):
        output = torch.full_like(scene.query, float("nan"))
        step.attend(layer, scene.query, output)
        for request, expected in zip(scene.requests, _reference(scene, layer), strict=True):
            got = output[request.query_start : request.query_start + request.query_len].float()
            tolerance = 2e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        served = torch.zeros(scene.tokens, dtype=torch.bool)
        for request in scene.requests:
            served[request.query_start : request.query_start + request.query_len] = True
        assert bool(output[~served].isnan().all())  # the plain rows are not written


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_a_head_size_of_64_takes_the_vectorised_unpacking_and_equals_the_per_chunk_path(fmt):
    """At 64 channels every width's codes are unpacked a vector of bytes at a time (2-bit planes need 64:
    the other tests' 32 take the scalar loop)."""
    scene = _scene(fmt, dim=64)
    _assert_equals_the_per_chunk_path(scene, range(LAYERS))


@pytest.mark.parametrize("q_heads", [3, 6, 12, 21], ids=lambda q: f"{q // KV_HEADS}-queries-a-kv-head")
@pytest.mark.parametrize("fmt", ["int4", "int8", None], ids=lambda f: f or "full-precision")
def test_any_number_of_query_heads_a_kv_head_equals_the_per_chunk_path(fmt, q_heads):
    """The kernel takes a tile's queries three at a time (logits and weighted values) and the rest one at a
    time: groups of 1, 2, 4 and 7 query heads (multi-head attention, Llama-3.1-8B's 4, Qwen2.5-7B's 7) leave
    one or two queries past the last three in a decode step, and tiles of any size in a first step. 8-bit
    codes are read in place by up to four queries, other widths by up to three (more unpack a block)."""
    scene = _scene(fmt, dim=64, q_heads=q_heads)
    _assert_equals_the_per_chunk_path(scene, range(LAYERS))


def test_keys_in_any_layout_of_the_engine_are_read_right():
    scene = _scene("int4", key_layout="table")
    assert scene.engine.layout == 1
    _assert_equals_the_per_chunk_path(scene, [2])


@pytest.mark.parametrize("key_layout", ["channel", "table"])
def test_blocks_longer_than_the_kernels_runs_of_entries_are_read_from_where_each_token_lies(key_layout):
    """64-token blocks (vLLM's CPU default is 128): a request's own tokens start and stop inside blocks."""
    scene = _scene("int4", key_layout=key_layout, block=64)
    _assert_equals_the_per_chunk_path(scene, [3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_slots_past_a_requests_own_tokens_are_never_used_whatever_they_hold(dtype):
    """64-token blocks: a float32 engine's own keys are read in place a whole run of 32 slots at a time, so
    the slots after a request's last token are loaded too; NaN there (another request's old bytes could
    be anything) must change nothing."""
    scene = _scene("int4", dtype, block=64)
    step = PoolStep(scene.engine, scene.requests)
    clean = torch.zeros_like(scene.query)
    step.attend(1, scene.query, clean)
    block = scene.engine.block_size
    for request in scene.requests:
        last = request.seq_len - 1
        where = int(request.blocks[last // block])
        past = torch.arange(last % block + 1, block)
        assert len(past)  # the scene's requests end inside a block
        cache = scene.engine.caches[1][where]  # (kv_heads, block, 2 · D): keys channel-major, then values
        keys = cache[:, :, :D].reshape(KV_HEADS, -1)[:, : block * D].view(KV_HEADS, D, block)
        keys[:, :, past] = float("nan")
        cache.reshape(KV_HEADS, -1)[:, block * D :].view(KV_HEADS, block, D)[:, past] = float("nan")
    output = torch.zeros_like(scene.query)
    step.attend(1, scene.query, output)
    assert torch.equal(output, clean)
    for request, expected in zip(scene.requests, _reference(scene, 1), strict=True):
        got = output[request.query_start : request.query_start + request.query_len].float()
        tolerance = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_the_reference_is_the_softmax_over_the_rows_and_the_own_tokens_in_float64():
    """The per-chunk path itself, against attention written out in float64 for one request and layer."""
    scene = _scene("int8")
    request, layer = scene.requests[2], 1
    rows = slice(request.query_start, request.query_start + request.query_len)
    got = attend_request_per_chunk(scene.engine, request, layer, scene.query[rows])
    plan = request.file.plan
    keys = {h: [] for h in range(KV_HEADS)}
    values = {h: [] for h in range(KV_HEADS)}
    betas = {h: [] for h in range(KV_HEADS)}
    for index, layout in enumerate(plan.chunks):
        stored = chunk_rows(scene.engine.chunk(request.blocks, index, LAYERS), layout, plan)
        k, v, beta = stored.to_padded()  # the file's rows, dequantized from the engine's chunks
        for position, seg in enumerate(layout.segments):
            if seg.layer == layer:
                n = seg.entries
                keys[seg.row].append(k[position, :n].double())
                values[seg.row].append(v[position, :n].double())
                betas[seg.row].append(beta[position, :n].double())
    own = request.seq_len - request.file.placeholders
    own_keys, own_values = scene.engine.own_tokens(request.blocks, layer, request.file.placeholders, own)
    group = Q_HEADS // KV_HEADS
    q = scene.query[rows].double()
    for head in range(Q_HEADS):
        h = head // group
        file_keys, file_values, beta = torch.cat(keys[h]), torch.cat(values[h]), torch.cat(betas[h])
        for j in range(request.query_len):
            turned = turn(q[j, head], turn_table(INV_FREQ, 1000 + request.file.placeholders))
            seen = own - request.query_len + j + 1
            logits = torch.cat(
                [turned @ file_keys.T * SCALE + beta, q[j, head] @ own_keys[:seen, h].double().T * SCALE]
            )
            expected = torch.softmax(logits, -1) @ torch.cat([file_values, own_values[:seen, h].double()])
            torch.testing.assert_close(got[j, head].double(), expected, rtol=1e-4, atol=1e-4)


def test_the_files_part_of_a_layer_is_one_call_whatever_the_requests_chunks_and_segments(monkeypatch):
    scene = _scene("int4")
    kernel = native.attend_pool_kernel()
    calls = []

    class Counting:
        openmp, debug = kernel.openmp, kernel.debug

        def workspace_floats(self, dim):
            return kernel.workspace_floats(dim)

        def attend(self, *args):
            calls.append(args[3])  # the layer
            return kernel.attend(*args)

    step = PoolStep(scene.engine, scene.requests, kernel=Counting())
    segments = sum(r.file.segments.shape[0] for r in scene.requests)
    assert len(scene.requests) == 3 and segments > 2 * LAYERS * KV_HEADS  # rows cut into several segments
    output = torch.zeros_like(scene.query)
    for layer in range(LAYERS):
        step.attend(layer, scene.query, output)
    assert calls == list(range(LAYERS))


def test_without_the_kernel_the_per_chunk_path_writes_the_same_rows():
    scene = _scene("int3")
    native_out, torch_out = torch.zeros_like(scene.query), torch.zeros_like(scene.query)
    PoolStep(scene.engine, scene.requests).attend(0, scene.query, native_out)
    fallback = PoolStep(scene.engine, scene.requests)
    fallback.kernel = None
    assert not fallback.native
    fallback.attend(0, scene.query, torch_out)
    torch.testing.assert_close(native_out, torch_out, rtol=2e-5, atol=2e-5)


def test_chunks_are_checked_once_after_a_load():
    scene = _scene("int4")
    request = scene.requests[0]
    check_chunks(scene.engine, request.file, request.blocks)
    scene.engine.chunk(request.blocks, 1, LAYERS)[:4] = 0
    with pytest.raises(PoolError, match="header"):
        check_chunks(scene.engine, request.file, request.blocks)


# ------------------------------------------------------------------------------------------ bounds
def _blocks_past_the_engine(scene: Scene) -> None:
    scene.requests[1].blocks[0] = scene.engine.num_blocks


def _a_sequence_past_its_block_table(scene: Scene) -> None:
    r = scene.requests[1]
    scene.requests[1] = StepRequest(r.query_start, r.query_len, r.seq_len + 200, r.file, r.blocks)


def _rows_past_the_step(scene: Scene) -> None:
    r = scene.requests[2]
    scene.requests[2] = StepRequest(scene.tokens - 3, r.query_len, r.seq_len, r.file, r.blocks)


def _rows_before_the_step(scene: Scene) -> None:
    r = scene.requests[0]  # 5 rows from −6: read from the end, they would be the last request's and plain rows
    scene.requests[0] = StepRequest(-6, r.query_len, r.seq_len, r.file, r.blocks)


def _a_segment_past_its_chunk(scene: Scene) -> None:
    file = scene.requests[0].file
    file.segments[int(file.row_start[0]), 2] = file.plan.chunk_bytes - 4  # layer 0, head 0: its key codes


def _a_chunk_that_is_not_the_files(scene: Scene) -> None:
    request = scene.requests[0]
    scene.engine.chunk(request.blocks, 0, LAYERS).zero_()


CORRUPTIONS = [
    _blocks_past_the_engine,
    _a_sequence_past_its_block_table,
    _rows_past_the_step,
    _a_segment_past_its_chunk,
]


REFUSED = {
    _blocks_past_the_engine: [1],
    _a_sequence_past_its_block_table: [1],
    _rows_past_the_step: [2],
    _rows_before_the_step: [0],
    _a_segment_past_its_chunk: [0, 2],  # their file's table
    _a_chunk_that_is_not_the_files: [0],  # its blocks do not hold its file (a load that failed)
}
"""The requests each corruption makes unfit (by their index in the scene)."""


@pytest.mark.parametrize("corrupt", list(REFUSED), ids=lambda f: f.__name__[1:])
def test_the_release_build_refuses_what_does_not_fit_before_reading(corrupt):
    """The whole call is refused (code 7) before anything is written; then each request alone says which."""
    scene = _scene("int4")
    corrupt(scene)
    kernel, calls = native.attend_pool_kernel(), []
    output = torch.full_like(scene.query, float("nan"))

    class Recording:
        openmp, debug = kernel.openmp, kernel.debug
        workspace_floats = staticmethod(kernel.workspace_floats)

        def attend(self, *args):
            untouched = bool(output.isnan().all())
            code = kernel.attend(*args)
            calls.append((args[2], code, untouched and bool(output.isnan().all())))  # requests, code, unwritten
            return code

    PoolStep(scene.engine, scene.requests, kernel=Recording()).attend(0, scene.query, output)
    assert calls[0] == (3, native.REQUEST_REFUSED, True)
    assert [code for count, code, _ in calls[1:4]] == [
        native.REQUEST_REFUSED if i in REFUSED[corrupt] else 0 for i in range(3)
    ]  # one at a time
    assert calls[4:] == [(3 - len(REFUSED[corrupt]), 0, False)]  # the fit ones again, in one call


def _refusal_scene(corrupt) -> tuple[Scene, list[StepRequest], list[StepRequest]]:
    """A scene with ``corrupt`` applied: the requests it makes unfit, and the others."""
    scene = _scene("int4")
    corrupt(scene)
    unfit = [scene.requests[i] for i in REFUSED[corrupt]]
    return scene, unfit, [r for r in scene.requests if all(r is not u for u in unfit)]


@pytest.mark.parametrize("corrupt", list(REFUSED), ids=lambda f: f.__name__[1:])
def test_a_request_that_does_not_fit_is_taken_out_of_the_step_and_the_others_are_attended(corrupt):
    """The engine goes on: the unfit requests are returned and left out of the later layers' calls (one
    call a layer again), their rows zeroed in every layer (whatever rows they claim); every other
    request's rows are what they are alone, and the rows of no request are not written."""
    scene, unfit, fit = _refusal_scene(corrupt)
    step = PoolStep(scene.engine, scene.requests)
    for layer in range(LAYERS):
        output = torch.full_like(scene.query, float("nan"))
        refused = step.attend(layer, scene.query, output)
        assert refused == (unfit if layer == 0 else [])
        assert step.requests == fit and step.refused == unfit
        for request in fit:
            rows = slice(request.query_start, request.query_start + request.query_len)
            expected = attend_request_per_chunk(scene.engine, request, layer, scene.query[rows])
            torch.testing.assert_close(output[rows], expected, rtol=2e-5, atol=2e-5)
        claimed = torch.zeros(scene.tokens, dtype=torch.bool)
        for request in unfit:  # zeroed in every layer (but for rows that a fit request claims too)
            claimed[max(request.query_start, 0) : max(request.query_start + request.query_len, 0)] = True
        for request in fit:
            claimed[request.query_start : request.query_start + request.query_len] = False
        assert not output[claimed].any()
        for request in fit:
            claimed[request.query_start : request.query_start + request.query_len] = True
        assert bool(output[~claimed].isnan().all())  # no other row written


def test_the_per_chunk_path_takes_out_a_request_whose_blocks_do_not_hold_its_file():
    scene, unfit, fit = _refusal_scene(_a_chunk_that_is_not_the_files)
    step = PoolStep(scene.engine, scene.requests)
    step.kernel = None
    output = torch.full_like(scene.query, float("nan"))
    assert step.attend(0, scene.query, output) == unfit and step.requests == fit
    for request in fit:
        rows = slice(request.query_start, request.query_start + request.query_len)
        expected = attend_request_per_chunk(scene.engine, request, 0, scene.query[rows])
        torch.testing.assert_close(output[rows], expected)
    assert not output[unfit[0].query_start : unfit[0].query_start + unfit[0].query_len].any()


def test_a_call_the_kernel_refuses_as_a_whole_still_raises():
    """An engine layout the kernel does not read is no request's fault: nothing is taken out."""
    scene = _scene("int4")
    step = PoolStep(scene.engine, scene.requests)
    with pytest.raises(RuntimeError, match="code 8"):
        step.attend(LAYERS, scene.query, torch.zeros_like(scene.query))  # a layer past the engine's
    assert step.requests == scene.requests and step.refused == []


@pytest.fixture
def debug_kernel(monkeypatch):
    monkeypatch.setenv(native.DEBUG_ENV, "1")
    native.attend_pool_kernel.cache_clear()
    kernel = native.attend_pool_kernel()
    assert kernel is not None and kernel.debug, native.pool_status()
    yield kernel
    native.attend_pool_kernel.cache_clear()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f or "full-precision")
def test_the_debug_build_computes_what_the_release_build_does(debug_kernel, fmt):
    """The debug build has no -march=native: it takes the kernel's generic vectors (no AVX2), the release
    build this machine's (the AVX2 unpacking and sums where it has them), every format at head size 64."""
    scene = _scene(fmt, dim=64)
    debug, release = torch.zeros_like(scene.query), torch.zeros_like(scene.query)
    PoolStep(scene.engine, scene.requests, kernel=debug_kernel).attend(1, scene.query, debug)
    PoolStep(scene.engine, scene.requests, kernel=native.load_pool_kernel(debug=False)).attend(1, scene.query, release)
    torch.testing.assert_close(debug, release, rtol=1e-5, atol=1e-5)  # sums in another order
    assert "debug build" in native.pool_status()


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__[1:])
def test_the_debug_build_checks_every_index_as_it_reads(debug_kernel, corrupt):
    scene = _scene("int4")
    corrupt(scene)
    step = PoolStep(scene.engine, scene.requests, kernel=debug_kernel)
    with pytest.raises(RuntimeError, match="code 5"):
        step.attend(0, scene.query, torch.zeros_like(scene.query))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")
@pytest.mark.parametrize("machine", ["x86-64", "skylake-avx512"])
@pytest.mark.parametrize("source", [native.POOL_SOURCE, native.SOURCE], ids=["pool", "codes"])
def test_the_kernel_compiles_for_other_machines_vectors(tmp_path, machine, source):
    """The release flags for other machines' vectors: without AVX2 (generic vectors) and with AVX-512
    (16-float vectors, which this machine may not run), at -O0 (always-inline intrinsics are checked
    against the target all the same, in seconds); each must build without a warning (but
    -Wpsabi's, on vectors passed between inline functions without AVX). Both kernels, on the blocks they
    share (attend_blocks.h)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    other = {"-march=native": f"-march={machine}", "-O3": "-O0"}
    flags = [other.get(flag, flag) for flag in native.FLAGS]
    built = subprocess.run(
        ["cc", *flags, "-Wall", "-Werror", "-Wno-psabi", "-o", str(tmp_path / "kernel.so"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]


# ------------------------------------------------------------------------------ requests sharing a file's blocks
def _shared_scene(fmt: str, threads: int = 2, decoders: int = 6) -> Scene:
    """Requests on files as an engine's prefix cache leaves them: ``decoders`` decode requests, a 5-token
    question and a 40-token one (two pieces) on file A's blocks, shared, in turn with two requests on file
    B; and, second, a request with A's tables whose own blocks hold other rows of A's shape (a load of
    other bytes with the same plan): it must not be read from A's blocks."""
    g = torch.Generator().manual_seed(7)
    caches = [torch.randn(400, KV_HEADS, BLOCK, 2 * D, generator=g) for _ in range(LAYERS)]
    engine = EngineCaches(caches, Q_HEADS, SCALE, threads=threads)
    chunk_bytes = KV_HEADS * BLOCK * 2 * D * caches[0].element_size()
    lengths = [[70, 0, 33], [5, 90, 64], [0, 0, 0], [41, 1, 77]]
    packed = [pack_pool([_rows(fmt, row, g, torch.float32) for row in lengths], chunk_bytes) for _ in range(3)]
    assert packed[0][0] == packed[2][0]  # same lengths, same plan: the third's bytes fit A's tables
    placeholders = math.ceil(packed[0][0].num_chunks / LAYERS) * BLOCK
    free = iter(torch.randperm(400, generator=g).tolist())

    def load(chunks) -> list[int]:
        held = [next(free) for _ in range(placeholders // BLOCK)]
        for c, chunk in enumerate(chunks):
            engine.chunk(torch.tensor(held, dtype=torch.int32), c, LAYERS).copy_(chunk)
        return held

    file_a = pooled_file(packed[0][0], placeholders, 1000 + placeholders, INV_FREQ)
    file_b = pooled_file(packed[1][0], placeholders, 1200 + placeholders, INV_FREQ)
    blocks_a, blocks_b = load(packed[0][1]), load(packed[1][1])
    kinds = [(file_a, blocks_a, 1, 30)] * decoders + [(file_a, blocks_a, 5, 5), (file_a, blocks_a, 40, 47)]
    kinds[2:2] = [(file_b, blocks_b, 1, 12), (file_b, blocks_b, 3, 3)]
    kinds.insert(1, (file_a, load(packed[2][1]), 1, 9))  # among A's decode requests
    requests, rows = [], 0
    for file, held, new, own in kinds:
        mine = [next(free) for _ in range(math.ceil(own / BLOCK))]
        blocks = torch.tensor(held + mine + [0], dtype=torch.int32)
        requests.append(StepRequest(rows, new, placeholders + own, file, blocks))
        rows += new + 1  # a plain row after each
    return Scene(engine, requests, torch.randn(rows, Q_HEADS, D, generator=g), rows)


@pytest.mark.parametrize("fmt", ["int4", "int3", "int8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_requests_on_one_files_blocks_share_a_pass_and_get_what_each_gets_alone(fmt, threads):
    """The tiles that read a file's rows once for several requests' queries: each request's rows are the
    bits it gets in a call of its own, and the per-chunk path's within float tolerances; the request whose
    blocks hold other bytes under the same tables is read from its own blocks."""
    scene = _shared_scene(fmt, threads)
    step = PoolStep(scene.engine, scene.requests)
    tiles = step.tiles()
    on_a = {n for n, r in enumerate(scene.requests) if r.file is scene.requests[0].file}
    shared = on_a - {1}
    assert any(len(tile) > 1 for tile in tiles)  # requests share passes over the file
    for tile in tiles:
        assert set(tile) <= shared or len(tile) == 1 or set(tile).isdisjoint(on_a)
    assert [len(tile) for tile in tiles if 1 in tile] == [1]
    output = torch.full_like(scene.query, float("nan"))
    for layer in (0, 3):
        step.attend(layer, scene.query, output)
        for request, expected in zip(scene.requests, _reference(scene, layer), strict=True):
            rows = slice(request.query_start, request.query_start + request.query_len)
            alone = torch.full_like(scene.query, float("nan"))
            PoolStep(scene.engine, [request]).attend(layer, scene.query, alone)
            assert torch.equal(output[rows], alone[rows])
            torch.testing.assert_close(output[rows], expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_a_files_tiles_hold_at_most_64_queries_and_enough_tiles_for_the_threads(threads):
    """24 decode requests on one file's blocks (3 queries a KV head each): as few tiles as the threads
    allow, none past 64 queries a KV head, every request in exactly one."""
    scene = _shared_scene("int4", threads, decoders=24)
    first = scene.requests[0]
    held = first.file.placeholders // BLOCK
    on_its_blocks = [
        r for r in scene.requests if r.query_len == 1 and torch.equal(r.blocks[:held], first.blocks[:held])
    ]
    step = PoolStep(scene.engine, on_its_blocks)
    assert len(step.requests) == 24
    tiles = step.tiles()
    group = Q_HEADS // KV_HEADS
    assert sorted(n for tile in tiles for n in tile) == list(range(24))
    assert all(len(tile) * group <= 64 for tile in tiles)
    assert len(tiles) == max(2, math.ceil(2 * threads / KV_HEADS))  # 72 queries; 2 items a thread
    output = torch.zeros_like(scene.query)
    step.attend(1, scene.query, output)
    for request in step.requests:
        rows = slice(request.query_start, request.query_start + request.query_len)
        expected = attend_request_per_chunk(scene.engine, request, 1, scene.query[rows])
        torch.testing.assert_close(output[rows], expected, rtol=2e-5, atol=2e-5)
