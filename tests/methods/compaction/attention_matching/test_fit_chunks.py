"""Fits that grow linearly (long contexts; Zweiger et al. 2026 §3.5, App. C.3): each repeat chunk's kept
entries fitted on the queries recorded while that chunk was repeated
(:mod:`kvfold.methods.compaction.attention_matching.fit_chunks`).

Cost is counted in operations (:data:`~kvfold.methods.compaction.attention_matching.grouping.FIT_PRODUCTS`),
not seconds.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kvfold
from kvfold.methods import SpecError, build_method
from kvfold.methods.compaction.attention_matching import fit_chunks
from kvfold.methods.compaction.attention_matching.fit_chunks import chunk_shares, fit_given_by_chunk, share_weights
from kvfold.methods.compaction.attention_matching.grouping import FIT_PRODUCTS
from kvfold.methods.compaction.attention_matching.queries import ReferenceQueries
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from tests.conftest import CharTokenizer, make_tiny_model

F64 = torch.float64
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps "
CHUNK = 64
PROMPT = 8
"""Repeat-prompt tokens before each chunk's text (their queries belong to the chunk)."""


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def model64(family: str = "llama"):
    return kvfold.enable(make_tiny_model(family).to(F64))


def synthetic(length: int, keep_every: int = 2, groups: int = 2, dim: int = 8, seed: int = 0):
    """One KV head of a context of ``length`` entries in repeat chunks of :data:`CHUNK`: keys,
    values, β⁰ = 0, the chunk of every slot, the repeat queries (``groups`` per repeat-input token,
    :data:`PROMPT` + :data:`CHUNK` tokens per chunk; each query reads its chunk's keys most) and
    every ``keep_every``-th entry kept (a fixed budget fraction)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, length, dim, generator=g, dtype=F64)
    values = torch.randn(1, 1, length, dim, generator=g, dtype=F64)
    chunk_of = (torch.arange(length) // CHUNK)[None]
    chunks = int(chunk_of.max()) + 1
    per_chunk = groups * (PROMPT + CHUNK)
    query_chunk = torch.arange(chunks).repeat_interleave(per_chunk)
    own = keys[0, 0].reshape(chunks, CHUNK, dim).mean(1).repeat_interleave(per_chunk, 0)
    queries = (own * 2 + torch.randn(chunks * per_chunk, dim, generator=g, dtype=F64))[None, None]
    ref = ReferenceQueries(queries, torch.ones(1, 1, queries.shape[2], dtype=torch.bool), query_chunk[None, None])
    given = torch.arange(0, length, keep_every)[None, None]
    return keys, values, torch.zeros(1, 1, length, dtype=F64), ref, chunk_of, given


def products(fit) -> int:
    before = FIT_PRODUCTS.products
    fit()
    return FIT_PRODUCTS.products - before


CONFIG = FitConfig(beta_min=0.0, beta_max=8.0, mass_weight="relative")  # am_fit's fit


def chunked(case):
    keys, values, beta0, ref, chunk_of, given = case
    return fit_given_by_chunk(keys, values, beta0, ref, chunk_of, given, 0.5, CONFIG)


def unchunked(case):
    keys, values, beta0, ref, _, given = case
    return fit_problems(keys, values, beta0, ref.queries, ref.valid, None, 0.5, CONFIG, given=given)


def same(a, b) -> bool:
    n = int(a.lengths.max())
    return (
        torch.equal(a.lengths, b.lengths)
        and torch.equal(a.log_mass[..., :n], b.log_mass[..., :n])
        and torch.equal(a.values[..., :n, :], b.values[..., :n, :])
    )


def second_chunk_alone(case, queries: ReferenceQueries):
    """Chunk 1's entries of a two-chunk ``case`` as a one-piece problem on ``queries``."""
    keys, values, beta0, _, chunk_of, given = case
    cut = (keys[:, :, CHUNK:], values[:, :, CHUNK:], beta0[:, :, CHUNK:])
    return (*cut, queries, chunk_of[:, CHUNK:] * 0, given[given >= CHUNK][None, None] - CHUNK)


def assert_ends_with(res, second) -> int:
    """``res``'s last entries are ``second``'s fit (float64 tolerance); returns where they start."""
    n = int(second.lengths)
    start = int(res.lengths) - n
    torch.testing.assert_close(res.log_mass[..., start:], second.log_mass[..., :n], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.values[..., start:, :], second.values[..., :n, :], rtol=1e-10, atol=1e-10)
    return start


# ---------------------------------------------------------------------------- (1) one chunk: the unchunked fit


def test_a_chunked_fit_of_one_chunk_is_the_unchunked_fit():
    case = synthetic(CHUNK, keep_every=3)
    assert same(chunked(case), unchunked(case))


@pytest.mark.parametrize(
    "spec",
    ["kvzip+am_fit[fit_chunk={}]", "knorm[online=false]+am_fit[fit_chunk={}]", "am_highest_fast[fit_chunk={}]"],
)
def test_a_context_of_one_chunk_compacts_as_without_chunks(spec):
    """The chunked path over a context of one repeat chunk gives today's cache bit for bit; ``auto``
    below 4,096 tokens takes the unchunked path itself."""
    pre = kvfold.prefill(model64(), CharTokenizer(), TEXT * 2, use_chat_template=False)
    plain = pre.compress(spec.format("none"), 0.3)
    one = pre.compress(spec.format(100000), 0.3)
    auto = pre.compress(spec.replace("[fit_chunk={}]", ""), 0.3)
    layers = zip(plain.cache.folded_layers, one.cache.folded_layers, auto.cache.folded_layers, strict=True)
    for (_, a), (_, b), (_, c) in layers:
        assert all(torch.equal(x, y) for x, y in zip(a.padded(), b.padded(), strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a.padded(), c.padded(), strict=True))


# ---------------------------------------------------------------------------- (2) cost in operations


def test_doubling_the_context_at_most_doubles_the_chunked_fit_products():
    """At a fixed budget fraction, the chunked fit's products grow like the length (×2 for ×2); the
    fit on every query grows like n·t² (×~8, at least ×6 here)."""
    short, long = synthetic(8 * CHUNK), synthetic(16 * CHUNK)
    by_chunk = products(lambda: chunked(long)) / products(lambda: chunked(short))
    whole = products(lambda: unchunked(long)) / products(lambda: unchunked(short))
    assert by_chunk <= 2.0
    assert whole >= 6.0


# ---------------------------------------------------------------------------- (3) two chunks


def test_each_chunk_is_fitted_to_its_own_entries():
    """On two chunks the chunked fit differs from the fit on every query, and a chunk that keeps all
    its entries (t = T) is reproduced exactly — its block is the chunk, not the whole context — while
    the unchunked fit refits those entries to stand in for the other chunk's evicted ones."""
    keys, values, beta0, ref, chunk_of, _ = synthetic(2 * CHUNK)
    given = torch.cat([torch.arange(CHUNK), torch.arange(CHUNK, 2 * CHUNK, 4)])[None, None]
    case = (keys, values, beta0, ref, chunk_of, given)
    res, whole = chunked(case), unchunked(case)
    assert int(res.lengths) == given.shape[-1] and torch.equal(res.index, given)
    assert torch.equal(res.log_mass[..., :CHUNK], beta0[..., :CHUNK])  # t = T: β = β⁰ ...
    assert torch.equal(res.values[..., :CHUNK, :], values[..., :CHUNK, :])  # ... and C_v = V
    assert not torch.allclose(whole.values[..., :CHUNK, :], values[..., :CHUNK, :], atol=1e-3)
    assert not torch.allclose(res.values[..., CHUNK:, :], whole.values[..., CHUNK:, :], atol=1e-3)


def test_the_second_chunk_fits_its_own_block_on_its_own_queries():
    """Chunk 1 alone (its entries, its queries) fitted unchunked is the chunked fit's chunk 1."""
    case = synthetic(2 * CHUNK)
    ref = case[3]
    res = chunked(case)
    mine = ref.chunk[0, 0] == 1
    second = unchunked(second_chunk_alone(case, ReferenceQueries(ref.queries[:, :, mine], ref.valid[:, :, mine])))
    assert_ends_with(res, second)


def test_two_repeat_chunks_of_a_model_fit_apart():
    """On a tiny model, chunks of 40 tokens: each chunk's repeat queries, and a result that differs
    from the unchunked fit; both keep the same entries."""
    pre = kvfold.prefill(model64(), CharTokenizer(), TEXT * 2, use_chat_template=False)
    plain = pre.compress("kvzip+am_fit[fit_chunk=none]", 0.3)
    split = pre.compress("kvzip+am_fit[fit_chunk=40]", 0.3)
    assert split.report["am_fit"]["fit_chunk"] == 40 and plain.report["am_fit"]["fit_chunk"] == 0
    for (_, a), (_, b) in zip(plain.cache.folded_layers, split.cache.folded_layers, strict=True):
        ka, va, _, la = a.padded()
        kb, vb, _, lb = b.padded()
        assert torch.equal(ka, kb) and torch.equal(la, lb)
        assert not torch.allclose(va, vb, atol=1e-6)


def test_fit_chunk_options_are_checked():
    assert build_method("kvzip+am_fit").folder.fit_chunk == "auto"
    for spec in ("kvzip+am_fit[fit_chunk=0]", "am_highest_fast[fit_chunk=big]", "am_highest[fit_chunk=64,chunks=2]"):
        with pytest.raises(SpecError):
            build_method(spec)


# ---------------------------------------------------------------------------- keys as stored (quantized)


def _perturbed(keys: torch.Tensor, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return keys + 0.3 * torch.randn(keys.shape, generator=g, dtype=keys.dtype)


@pytest.mark.parametrize("fit", [chunked, unchunked], ids=["chunked", "unchunked"])
def test_compact_keys_equal_to_the_keys_change_nothing_and_others_are_absorbed(fit):
    """``compact_keys`` = the keys gives the plain fit bit for bit; other compact keys (as quantized
    storage gives them back) give a fit whose attention, read with those keys, is closer to the
    target than the plain fit's read with them (the fit absorbs the difference)."""
    case = synthetic(2 * CHUNK, keep_every=3)
    keys, values, beta0, ref, chunk_of, given = case

    def run(compact):
        if fit is chunked:
            return fit_given_by_chunk(keys, values, beta0, ref, chunk_of, given, 0.5, CONFIG, compact)
        return fit_problems(
            keys, values, beta0, ref.queries, ref.valid, None, 0.5, CONFIG, given=given, compact_keys=compact
        )

    assert same(run(keys), fit(case))
    stored = _perturbed(keys)
    absorbed, plain = run(stored), fit(case)
    q = ref.queries[0, 0]
    target = torch.softmax(q @ keys[0, 0].mT * 0.5, -1) @ values[0, 0]
    kept = stored[0, 0, given[0, 0]]

    def error(result) -> float:
        n = int(result.lengths.max())
        out = torch.softmax(q @ kept[:n].mT * 0.5 + result.log_mass[0, 0, :n], -1) @ result.values[0, 0, :n]
        return float((out - target).norm() / target.norm())

    assert error(absorbed) < 0.9 * error(plain)


# ---------------------------------------------------------------------------- queries every chunk reads


def test_shared_queries_are_evenly_spaced_and_leave_their_chunk():
    _, _, _, ref, _, _ = synthetic(4 * CHUNK)
    total = ref.queries.shape[2]
    assert ref.share_across_chunks(0) is ref
    shared = ref.share_across_chunks(8)
    moved = (shared.chunk[0, 0] < 0).nonzero().flatten()
    assert moved.numel() == 8 and torch.equal(moved, torch.arange(8) * (total // 8) + total // 8 - 1)
    assert torch.equal(shared.chunk[0, 0][shared.chunk[0, 0] >= 0], ref.chunk[0, 0][shared.chunk[0, 0] >= 0])
    assert bool((ref.share_across_chunks(10 * total).chunk < 0).all())  # all of them, never more
    half = ReferenceQueries(ref.queries, ref.valid & (torch.arange(total) % 2 == 0), ref.chunk)
    assert bool(half.valid[half.share_across_chunks(total).chunk < 0].all())  # invalid queries are never moved


def test_a_chunk_reading_every_query_fits_its_own_block_on_all_of_them():
    """With every query shared, chunk 1's fit is chunk 1's entries alone fitted on every query: its
    target is still its own block's mass and output (§2), read by queries from both chunks."""
    keys, values, beta0, ref, chunk_of, given = synthetic(2 * CHUNK)
    shared = ref.share_across_chunks(ref.queries.shape[2])
    res = chunked((keys, values, beta0, shared, chunk_of, given))
    own = chunked((keys, values, beta0, ref, chunk_of, given))
    case = (keys, values, beta0, ref, chunk_of, given)
    second = unchunked(second_chunk_alone(case, ReferenceQueries(ref.queries, ref.valid)))
    start = assert_ends_with(res, second)
    assert not torch.allclose(res.values[..., start:, :], own.values[..., start:, :], atol=1e-3)


def test_a_fixed_number_of_shared_queries_keeps_the_fit_linear():
    """Every chunk reads its own queries and the same ``s`` shared ones: doubling the context about
    doubles the products (a chunk's own queries that are shared are read once, so slightly more
    than 2), where the fit on every query grows ×6 or more (above)."""
    short, long = synthetic(8 * CHUNK), synthetic(16 * CHUNK)
    count = 2 * (PROMPT + CHUNK) * 2  # two chunks' worth of queries

    def with_shared(case):
        keys, values, beta0, ref, chunk_of, given = case
        return chunked((keys, values, beta0, ref.share_across_chunks(count), chunk_of, given))

    grown = products(lambda: with_shared(long)) / products(lambda: with_shared(short))
    assert grown <= 2.2
    assert products(lambda: with_shared(long)) > products(lambda: chunked(long))


def test_am_fit_shares_queries_only_in_a_chunked_fit():
    pre = kvfold.prefill(model64(), CharTokenizer(), TEXT * 2, use_chat_template=False)
    split = pre.compress("kvzip+am_fit[fit_chunk=40]", 0.3)
    shared = pre.compress("kvzip+am_fit[fit_chunk=40,shared_queries=64]", 0.3)
    plain = pre.compress("kvzip+am_fit[fit_chunk=none]", 0.3)
    whole = pre.compress("kvzip+am_fit[fit_chunk=none,shared_queries=64]", 0.3)
    layers = zip(split.cache.folded_layers, shared.cache.folded_layers, strict=True)
    assert any(not torch.allclose(a.padded()[1], b.padded()[1], atol=1e-6) for (_, a), (_, b) in layers)
    for (_, a), (_, b) in zip(plain.cache.folded_layers, whole.cache.folded_layers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.padded(), b.padded(), strict=True))
    with pytest.raises(SpecError):
        build_method("kvzip+am_fit[shared_queries=-1]")


# ---------------------------------------------------------------------------- chunks weighted by their share


def test_chunk_shares_are_each_chunks_part_of_a_querys_attention():
    keys, _, beta0, ref, chunk_of, _ = synthetic(3 * CHUNK)
    beta0 = beta0.clone()
    beta0[..., 5] = -math.inf  # an entry the fit does not match counts nowhere
    weights = torch.softmax(ref.queries[0, 0] @ keys[0, 0].mT * 0.5 + beta0[0, 0], -1)
    expected = torch.stack([weights[:, chunk_of[0] == c].sum(-1) for c in range(3)], -1)
    blocks, block_beta = keys.view(1, 1, 3, CHUNK, -1), beta0.view(1, 1, 3, CHUNK)
    torch.testing.assert_close(
        chunk_shares(blocks, block_beta, ref.queries, 0.5)[0, 0], expected, rtol=1e-12, atol=1e-12
    )
    as32 = chunk_shares(blocks.float(), block_beta.float(), ref.queries.float(), 0.5)  # the fused CPU kernel
    torch.testing.assert_close(as32[0, 0], expected.float(), rtol=1e-5, atol=1e-6)
    block_beta = block_beta.clone()
    block_beta[:, :, 1] = -math.inf  # a chunk that matches nothing has no share
    for dt in (F64, torch.float32):
        none = chunk_shares(blocks.to(dt), block_beta.to(dt), ref.queries.to(dt), 0.5)
        assert bool((none[..., 1] == 0).all()) and torch.allclose(none.sum(-1), torch.ones((), dtype=dt))


@pytest.mark.parametrize("solver", ["gram", "exact"])
def test_a_query_weight_of_two_is_the_query_counted_twice(solver):
    """fit_problems' ``query_weight`` weighs a query's squared residuals in the mass and the value fit
    and the output error: weight 2 on a few queries gives the fit on those queries repeated (float64),
    with either solver."""
    config = replace(CONFIG, solver=solver)
    keys, values, beta0, ref, _, given = synthetic(CHUNK, keep_every=3)
    q, qv = ref.queries, ref.valid
    twice = torch.zeros(q.shape[2], dtype=torch.bool)
    twice[::7] = True
    weight = 1.0 + twice.to(F64)[None, None]
    weighted = fit_problems(keys, values, beta0, q, qv, None, 0.5, config, given=given, query_weight=weight)
    q2 = torch.cat([q, q[:, :, twice]], dim=2)
    qv2 = torch.cat([qv, qv[:, :, twice]], dim=2)
    repeated = fit_problems(keys, values, beta0, q2, qv2, None, 0.5, config, given=given)
    plain = fit_problems(keys, values, beta0, q, qv, None, 0.5, config, given=given)
    for name in ("log_mass", "values", "output_error"):
        torch.testing.assert_close(getattr(weighted, name), getattr(repeated, name), rtol=1e-8, atol=1e-8)
    assert not torch.allclose(weighted.values, plain.values, atol=1e-6)


def test_a_chunk_weighted_by_share_fits_its_block_with_those_weights():
    """``by_share``: chunk 1's fit is chunk 1's entries fitted on its queries, each query's residuals
    weighted by chunk 1's share of that query's attention, squared; not the fit of ``own``."""
    keys, values, beta0, ref, chunk_of, given = synthetic(2 * CHUNK)
    res = fit_given_by_chunk(keys, values, beta0, ref, chunk_of, given, 0.5, CONFIG, by_share=True)
    own = chunked((keys, values, beta0, ref, chunk_of, given))
    mine = ref.chunk[0, 0] == 1
    share = torch.softmax(ref.queries[0, 0] @ keys[0, 0].mT * 0.5, -1)[:, CHUNK:].sum(-1)
    alone = fit_problems(
        keys[:, :, CHUNK:],
        values[:, :, CHUNK:],
        beta0[:, :, CHUNK:],
        ref.queries[:, :, mine],
        ref.valid[:, :, mine],
        None,
        0.5,
        CONFIG,
        given=given[given >= CHUNK][None, None] - CHUNK,
        query_weight=share[mine].square()[None, None],
    )
    start = assert_ends_with(res, alone)
    assert not torch.allclose(res.values[..., start:, :], own.values[..., start:, :], atol=1e-4)


def test_one_chunk_weighted_by_share_is_the_unchunked_fit():
    case = synthetic(CHUNK, keep_every=3)
    keys, values, beta0, ref, chunk_of, given = case
    assert same(
        fit_given_by_chunk(keys, values, beta0, ref, chunk_of, given, 0.5, CONFIG, by_share=True), unchunked(case)
    )


def with_context_lse(case, shared: int = 0):
    """``case`` with every repeat query's float64 log-sum-exp over the context (what the repeat
    pass records), ``shared`` of them given to every chunk."""
    keys, values, beta0, ref, chunk_of, given = case
    lse = torch.logsumexp(ref.queries @ keys.mT * 0.5 + beta0[:, :, None, :], dim=-1)
    ref = ReferenceQueries(ref.queries, ref.valid, ref.chunk, lse).share_across_chunks(shared)
    return keys, values, beta0, ref, chunk_of, given


def test_shares_from_the_recorded_context_mass_equal_the_shares_over_every_block(monkeypatch):
    """With each query's mass over the context known (and every entry matched), a chunk's own
    queries need their own block only and shared queries every block: the weights equal the
    shares over every block, without them; an offset in the recorded mass moves them, and where
    the context is not what the fit matches, or a mass is not known, it is not read."""
    keys, values, beta0, ref, chunk_of, _ = with_context_lse(synthetic(3 * CHUNK), shared=7)
    blocks, block_beta = keys.view(1, 1, 3, CHUNK, -1), beta0.view(1, 1, 3, CHUNK)
    block_queries = ref.by_chunk(3)[0]
    everywhere = share_weights(blocks, block_beta, block_queries, ref, 0.5, context_is_matched=False)
    real = fit_chunks.chunk_shares
    calls = []
    monkeypatch.setattr(fit_chunks, "chunk_shares", lambda *a: calls.append(1) or real(*a))
    recorded = share_weights(blocks, block_beta, block_queries, ref, 0.5, context_is_matched=True)
    assert not calls
    torch.testing.assert_close(recorded, everywhere, rtol=1e-12, atol=1e-12)
    index, index_ok = ref.chunk_index(3)
    assert bool((index_ok & (ref.chunk.gather(2, index.flatten(2)).view_as(index) < 0)).any())  # shared ones
    shifted = ReferenceQueries(ref.queries, ref.valid, ref.chunk, ref.context_lse + 1.0)
    moved = share_weights(blocks, block_beta, block_queries, shifted, 0.5, context_is_matched=True)
    assert not torch.allclose(moved, everywhere, atol=1e-3)
    assert torch.equal(share_weights(blocks, block_beta, block_queries, shifted, 0.5, False), everywhere)
    unknown = ReferenceQueries(ref.queries, ref.valid, ref.chunk, ref.context_lse.clone())
    unknown.context_lse[..., 3] = math.nan  # a query of chunk 0 without it
    torch.testing.assert_close(share_weights(blocks, block_beta, block_queries, unknown, 0.5, True), everywhere)
    assert len(calls) == 2


def test_a_fit_weighted_by_share_is_the_same_from_the_recorded_context_mass():
    case = with_context_lse(synthetic(2 * CHUNK))
    keys, values, beta0, ref, chunk_of, given = case
    args = (keys, values, beta0, ref, chunk_of, given, 0.5, CONFIG)
    recorded = fit_given_by_chunk(*args, by_share=True, context_is_matched=True)
    everywhere = fit_given_by_chunk(*args, by_share=True)
    torch.testing.assert_close(recorded.log_mass, everywhere.log_mass, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(recorded.values, everywhere.values, rtol=1e-9, atol=1e-9)


def test_am_fit_weighs_by_share_from_the_repeat_pass_unless_entries_stay_verbatim(monkeypatch):
    """A float32 model's repeat pass records each query's mass over the context, and ``share`` reads
    it instead of an attention over the context: in a real compression the weights equal the shares
    over every block (the fit itself, in float32 on a tiny random model, moves β by 10⁻² for a 10⁻⁷
    change of its weights: the weights are what is compared). With sinks kept verbatim the context
    is not what the fit matches: the shares are computed over every block."""
    real_shares, real_weights = fit_chunks.chunk_shares, fit_chunks.share_weights
    calls, compared = [], []

    def checked(blocks, block_beta, block_queries, queries, scaling, matched):
        weights = real_weights(blocks, block_beta, block_queries, queries, scaling, matched)
        everywhere = real_weights(blocks, block_beta, block_queries, queries, scaling, False)
        torch.testing.assert_close(weights, everywhere, rtol=0, atol=1e-5)
        compared.append(matched)
        return weights

    monkeypatch.setattr(fit_chunks, "share_weights", checked)
    monkeypatch.setattr(fit_chunks, "chunk_shares", lambda *a: calls.append(1) or real_shares(*a))
    model = kvfold.enable(make_tiny_model("llama"))
    spec = "kvzip+am_fit[fit_chunk=40,chunk_weights=share]"
    kvfold.prefill(model, CharTokenizer(), TEXT * 2, use_chat_template=False).compress(spec, 0.3)
    assert compared == [True, True] and len(calls) == 2  # every layer from the pass; the check's own calls
    compared.clear()
    kvfold.prefill(model, CharTokenizer(), TEXT * 2, use_chat_template=False).compress(spec[:-1] + ",sinks=4]", 0.3)
    assert compared == [False, False]


def test_am_fit_weighs_chunks_by_share_by_default():
    pre = kvfold.prefill(model64(), CharTokenizer(), TEXT * 2, use_chat_template=False)
    own = pre.compress("kvzip+am_fit[fit_chunk=40,chunk_weights=own]", 0.3)
    share = pre.compress("kvzip+am_fit[fit_chunk=40]", 0.3)
    layers = zip(own.cache.folded_layers, share.cache.folded_layers, strict=True)
    assert any(not torch.allclose(a.padded()[1], b.padded()[1], atol=1e-6) for (_, a), (_, b) in layers)
    exact_own = pre.compress("kvzip+am_fit[fit_chunk=40,chunk_weights=own,solver=exact]", 0.3)
    exact_share = pre.compress("kvzip+am_fit[fit_chunk=40,chunk_weights=share,solver=exact]", 0.3)
    layers = zip(exact_own.cache.folded_layers, exact_share.cache.folded_layers, strict=True)
    assert any(not torch.allclose(a.padded()[1], b.padded()[1], atol=1e-6) for (_, a), (_, b) in layers)
    assert build_method("kvzip+am_fit").folder.chunk_weights == "share"
    with pytest.raises(SpecError, match="own or share"):
        build_method("kvzip+am_fit[chunk_weights=both]")
