"""Attention Matching (Zweiger et al. 2026): the paper's identities as property tests, the solvers
against float64 references, and every variant end to end on every tiny family and a padded batch.

Models run in float64 so that "exact" means rounding error.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.methods import REGISTRY, CompressionContext, SpecError, build_method
from kvfold.methods.compaction.attention_matching.compact import compact_layers
from kvfold.methods.compaction.attention_matching.features import Group
from kvfold.methods.compaction.attention_matching.queries import QueryOptions, extract_reference_queries
from kvfold.methods.compaction.attention_matching.schedule import (
    HeadSchedule,
    _interp,
    build_head_schedule,
    config_hash,
    greedy_swap,
)
from kvfold.methods.compaction.attention_matching.solve import FitConfig, _fit_group, fit_problems
from kvfold.methods.compaction.attention_matching.solvers import box_nnls, omp_keys
from kvfold.methods.compaction.linalg import nnls, nnls_reference
from kvfold.methods.compaction.omp import omp_select
from kvfold.methods.core.repeat import RepeatPrompt
from kvfold.pipeline.chunked import prefill_chunked
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer, make_tiny_model

F64 = torch.float64
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps "
VARIANTS = [
    "am_highest[selfstudy_tokens=3]",
    "am_highest_fast",
    "am_omp[selfstudy_tokens=3]",
    "am_omp_fast[selfstudy_tokens=3]",
    "streamingllm[online=false]+am_fit",
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny problems: one thread avoids oversubscription on shared machines."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def model64(family: str = "llama"):
    return kvfold.enable(make_tiny_model(family).to(F64))


def block(seed: int = 0, T: int = 24, n: int = 60, D: int = 8, B: int = 3):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, T, D, generator=g, dtype=F64) * 1.5
    values = torch.randn(B, T, D, generator=g, dtype=F64)
    queries = torch.randn(B, n, D, generator=g, dtype=F64) * 1.5
    beta0 = torch.randn(B, T, generator=g, dtype=F64) * 0.5  # entries that already stand for several tokens
    beta0[0, 3] = -math.inf  # an empty slot
    return keys, values, beta0, queries


def attend(queries, keys, values, beta, scaling):
    """Per query: attention output, mass Σ exp(ℓ) (unshifted), from ``logits = s q·k + β``."""
    logits = queries @ keys.mT * scaling + beta[..., None, :]
    mass = torch.logsumexp(logits, dim=-1)
    return torch.softmax(logits, dim=-1) @ values, mass


def compacted_block(res, keys, values):
    ok = torch.arange(res.index.shape[-1])[None] < res.lengths[:, None]
    c_k = keys.gather(1, res.index[..., None].expand(-1, -1, keys.shape[-1]))
    beta = res.log_mass.masked_fill(~ok, -math.inf)
    return c_k, res.values, beta


# ---------------------------------------------------------------------------- identities of §2 / App. A


@pytest.mark.parametrize("keys_kind", ["highest", "omp"])
def test_full_count_reproduces_the_block_exactly(keys_kind):
    """t = T: the compacted block is the block (β = β⁰, C_v = V), so output and mass match for
    any query, even with fewer reference queries than entries."""
    keys, values, beta0, queries = block(n=10)  # n < T: the fit alone cannot pin the solution
    counts = torch.isfinite(beta0).sum(-1)
    s = keys.shape[-1] ** -0.5
    config = FitConfig(keys=keys_kind)
    valid = torch.ones(queries.shape[:2], dtype=torch.bool)
    group = Group.prepare(keys, values, beta0, queries, valid, torch.full((3,), s, dtype=F64))
    res = _fit_group(group, counts, config)
    assert res.lengths.tolist() == counts.tolist()
    c_k, c_v, beta = compacted_block(res, keys, values)
    probe = torch.randn(3, 40, keys.shape[-1], generator=torch.Generator().manual_seed(5), dtype=F64) * 2
    out_full, mass_full = attend(probe, keys, values, beta0, s)
    out, mass = attend(probe, c_k, c_v, beta, s)
    # rounding only (the fits see an exactly-zero residual; the ridge keeps the null space at the prior)
    torch.testing.assert_close(out, out_full, rtol=0, atol=1e-7)
    torch.testing.assert_close(mass, mass_full, rtol=0, atol=1e-7)


def test_appending_tokens_matches_uncompacted_attention_up_to_the_fit_error():
    """App. A.2 eq. 5: with fixed entries appended, the error on a reference query is bounded by
    the block's output error and its mass error; and AM beats plain eviction of the same keys."""
    keys, values, beta0, queries = block(seed=1, T=40, n=200)
    beta0 = torch.where(torch.isfinite(beta0), torch.zeros_like(beta0), beta0)
    s = keys.shape[-1] ** -0.5
    valid_q = torch.ones(queries.shape[:2], dtype=torch.bool)
    res = fit_problems(keys, values, beta0, queries, valid_q, torch.full((3,), 10), s, FitConfig())
    c_k, c_v, beta = compacted_block(res, keys, values)
    g = torch.Generator().manual_seed(9)
    k_fix, v_fix = torch.randn(3, 6, 8, generator=g, dtype=F64), torch.randn(3, 6, 8, generator=g, dtype=F64)
    zero = torch.zeros(3, 6, dtype=F64)
    full, _ = attend(
        queries, torch.cat([keys, k_fix], 1), torch.cat([values, v_fix], 1), torch.cat([beta0, zero], 1), s
    )
    ours, _ = attend(queries, torch.cat([c_k, k_fix], 1), torch.cat([c_v, v_fix], 1), torch.cat([beta, zero], 1), s)
    a, log_m = attend(queries, keys, values, beta0, s)
    a_c, log_mc = attend(queries, c_k, c_v, beta, s)
    f, log_f = attend(queries, k_fix, v_fix, zero, s)
    alpha = torch.sigmoid(log_m - log_f)[..., None]  # M / (M + F)
    alpha_c = torch.sigmoid(log_mc - log_f)[..., None]
    bound = alpha * (a - a_c).norm(dim=-1, keepdim=True) + (alpha - alpha_c).abs() * (a_c - f).norm(
        dim=-1, keepdim=True
    )
    assert bool(((ours - full).norm(dim=-1, keepdim=True) <= bound + 1e-12).all())
    # the same keys without fitted β and values (eviction) are worse on the reference queries
    plain = torch.where(torch.isfinite(beta), torch.zeros_like(beta), beta)
    v_plain = values.gather(1, res.index[..., None].expand(-1, -1, 8))
    evicted, _ = attend(
        queries, torch.cat([c_k, k_fix], 1), torch.cat([v_plain, v_fix], 1), torch.cat([plain, zero], 1), s
    )
    assert (ours - full).norm() < 0.7 * (evicted - full).norm()


def test_compacted_cache_keeps_positions_and_stores_beta():
    """Through a real cache: compacting layer entries then appending tokens (layer.update) gives
    the attention the fit predicts; the logical length is unchanged."""
    model = model64("llama")
    tok = CharTokenizer()
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    cache = pre.cache.copy()
    layer_idx, layer = cache.folded_layers[0]
    ctx = CompressionContext(
        model=model,
        cache=cache,
        input_ids=pre.input_ids,
        attention_mask=pre.attention_mask,
        budget=Budget.parse(0.25),
        tokenizer=tok,
    )
    queries = extract_reference_queries(ctx, QueryOptions(sources=("random",), random_queries=300))
    keys0, values0, _, _ = layer.padded()
    keys0, values0 = keys0.clone(), values0.clone()
    logical = layer.logical_length
    compact_layers([(layer_idx, layer)], queries, {layer_idx: torch.full((1, 2), 12)}, {layer_idx: 0.25}, FitConfig())
    assert layer.logical_length == logical and layer.physical_length == 12
    k_new, v_new = torch.randn(1, 2, 3, 16, dtype=F64), torch.randn(1, 2, 3, 16, dtype=F64)
    layer.update(k_new, v_new)
    keys, values, log_mass, _ = layer.padded()
    q = queries[layer_idx].queries
    ours, _ = attend(q, keys, values, log_mass, 0.25)
    full, _ = attend(
        q,
        torch.cat([keys0, k_new], 2),
        torch.cat([values0, v_new], 2),
        torch.zeros(1, 2, keys0.shape[2] + 3, dtype=F64),
        0.25,
    )
    assert float((ours - full).norm() / full.norm()) < 0.2


# ---------------------------------------------------------------------------- solvers


@pytest.mark.parametrize(("k", "tau"), [(1, 1), (4, 2)])
def test_omp_mass_residual_is_non_increasing(k, tau):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 80, 50, generator=g, dtype=F64) * 2
    phi = torch.exp(logits - logits.amax(-1, keepdim=True))
    mass = phi.sum(-1)
    idx, w, lengths, history = omp_keys(
        phi, mass, torch.full((4,), 20), torch.ones(4, 50, dtype=torch.bool), k=k, tau=tau, beta_min=None
    )
    assert bool((history[:, 1:] <= history[:, :-1] * (1 + 1e-9) + 1e-12).all())
    assert history[:, -1].max() < history[:, 0].min()
    residual = (mass - (phi.gather(2, idx[:, None, :].expand(-1, 80, -1)) * w[:, None, :]).sum(-1)).norm(dim=-1)
    torch.testing.assert_close(residual, history[:, -1], rtol=1e-9, atol=1e-12)
    # Algorithms 1-2 verbatim (refine=False) select what the reference implementation selects
    plain = omp_keys(
        phi, mass, torch.full((4,), 20), torch.ones(4, 50, dtype=torch.bool), k=k, tau=tau, ridge=1e-12, refine=False
    )
    ref = omp_select(phi, mass, 20, k=k, refit_every=tau, ridge=1e-12)
    assert torch.equal(plain[0], ref.indices)
    torch.testing.assert_close(plain[1], ref.weights, rtol=1e-7, atol=1e-9)


def test_omp_beta_min_pruning_resumes_at_most_refills_times():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 80, 50, generator=g, dtype=F64) * 5  # a few keys carry the mass
    phi = torch.exp(logits - logits.amax(-1, keepdim=True))
    mass = phi.sum(-1)
    runs = {}
    for refills in (0, 2, 1000):
        idx, w, lengths, history = omp_keys(
            phi,
            mass,
            torch.full((4,), 20),
            torch.ones(4, 50, dtype=torch.bool),
            k=4,
            tau=2,
            beta_min=0.5,
            refills=refills,
        )
        kept = torch.arange(20)[None, :] < lengths[:, None]
        assert bool((w[kept] >= math.exp(0.5)).all()) and bool((w[~kept] == 0).all())  # App. C.2: β ≥ β_min
        runs[refills] = (int(lengths.sum()), history.shape[-1])
    assert runs[0][0] < runs[1000][0]  # refilling after a pruning keeps more of the budget
    assert runs[0][1] <= runs[2][1] <= runs[1000][1]


def test_nnls_matches_the_float64_reference():
    g = torch.Generator().manual_seed(4)
    A = torch.rand(5, 40, 12, generator=g, dtype=F64) ** 2
    b = (A @ torch.randn(5, 12, 1, generator=g, dtype=F64))[..., 0] + 0.1 * torch.randn(5, 40, generator=g, dtype=F64)
    ok = torch.ones(5, 12, dtype=torch.bool)
    gram, corr = A.mT @ A, (b[:, None, :] @ A)[:, 0]
    w = box_nnls(gram, corr, ok, lower=0.0, upper=None, iters=20000, ridge=1e-14)
    for p in range(5):
        torch.testing.assert_close(w[p], nnls_reference(A[p], b[p]), rtol=1e-5, atol=1e-6)
    # Algorithm 3 with iters = 0 is the clamped least-squares solution, as in kvfold.methods.compaction.linalg.nnls
    w0 = box_nnls(gram, corr, ok, lower=0.0, upper=None, iters=0, ridge=1e-14)
    torch.testing.assert_close(w0, nnls(A, b, iters=0, lower=0.0), rtol=1e-6, atol=1e-8)
    # and the two steps of AM-HighestAttnKeys agree with the reference implementation in a box
    box = box_nnls(gram, corr, ok, lower=0.05, upper=20.0, iters=2, ridge=1e-14)
    torch.testing.assert_close(box, nnls(A, b, iters=2, lower=0.05, upper=20.0), rtol=1e-6, atol=1e-8)


def test_gram_and_exact_solvers_agree():
    keys, values, beta0, queries = block(seed=6, T=30, n=120)
    valid_q = torch.ones(queries.shape[:2], dtype=torch.bool)
    counts = torch.full((3,), 8)
    fast = fit_problems(keys, values, beta0, queries, valid_q, counts, 0.35, FitConfig(ridge=1e-12))
    exact = fit_problems(keys, values, beta0, queries, valid_q, counts, 0.35, FitConfig(ridge=1e-12, solver="exact"))
    assert torch.equal(fast.index, exact.index)
    torch.testing.assert_close(fast.log_mass, exact.log_mass, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.values, exact.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("spec", "low", "high"), [("am_highest_fast", -3.0, 3.0), ("am_omp_fast", -7.0, 7.0)])
def test_beta_bounds_are_respected(spec, low, high):
    model = model64("qwen2")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT * 2, use_chat_template=False)
    small = pre.compress(f"{spec}[queries=repeat+random]", 0.1)
    for _, layer in small.cache.folded_layers:
        beta = layer.padded()[2]
        beta = beta[torch.isfinite(beta)]
        assert bool((beta >= low - 1e-9).all()) and bool((beta <= high + 1e-9).all())
        assert float(beta.abs().max()) > 0.5  # β is really fitted (mass of ~10 tokens per entry)


# ---------------------------------------------------------------------------- every variant, every family


@pytest.mark.parametrize("spec", VARIANTS)
def test_variants_run_on_every_family_and_a_padded_batch(tiny_family, spec):
    model = kvfold.enable(make_tiny_model(tiny_family))
    tok = CharTokenizer()
    contexts = [TEXT * 2, "a short one, really short"]
    batch = kvfold.prefill(model, tok, contexts, use_chat_template=False, methods=[spec])
    small = batch.compress(spec, 0.3)
    budgets = Budget.parse(0.3).counts(batch.attention_mask.sum(-1).cpu())
    for _, layer in small.cache.folded_layers:
        assert layer.logical_length == batch.input_ids.shape[1]
        assert bool((layer.row_lengths() <= budgets[:, None]).all())
    answers = small.generate("why?", max_new_tokens=3, use_chat_template=False)
    assert len(answers) == 2 and all(a.new_tokens >= 1 for a in answers)


# ---------------------------------------------------------------------------- spans, chunks, schedules


def test_span_keeps_outside_entries_bit_identical():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    small = pre.compress("am_highest_fast[span=3:-4,queries=random]", 0.3)
    for (_, full), (_, layer) in zip(pre.cache.folded_layers, small.cache.folded_layers, strict=True):
        k_full, v_full, _, _ = full.padded()
        keys, values, beta, lengths = layer.padded()
        assert int(lengths.max()) == math.ceil(0.3 * k_full.shape[2])
        assert torch.equal(keys[:, :, :3], k_full[:, :, :3]) and torch.equal(values[:, :, -4:], v_full[:, :, -4:])
        assert torch.equal(beta[:, :, :3], torch.zeros_like(beta[:, :, :3]))
        assert layer.logical_length == full.logical_length


def test_kv_chunks_compact_each_chunk_alone():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    n = pre.input_ids.shape[1]
    small = pre.compress("am_highest_fast[chunks=3,queries=random,template=false,sinks=0]", 12)
    for (_, full), (_, layer) in zip(pre.cache.folded_layers, small.cache.folded_layers, strict=True):
        k_full = full.padded()[0][0, 0]
        keys = layer.padded()[0][0, 0]
        assert keys.shape[0] == 12
        # each chunk keeps 4 of its own keys, in order: chunk c's keys come from positions of chunk c
        positions = [int((k_full - k).abs().sum(-1).argmin()) for k in keys]
        assert positions == sorted(positions)
        bounds = [c * n // 3 for c in range(4)]
        for c in range(3):
            assert sum(bounds[c] <= p < bounds[c + 1] for p in positions) == 4


def test_text_chunks_are_shifted_to_their_global_rope_phase():
    """Layer 0 keys depend on the token and its position only: a chunk prefilled alone at local
    positions and rotated by Δ must equal the full prefill's keys."""
    model = model64("llama")
    tok = CharTokenizer()
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    cache = pre.cache.copy()
    ctx = CompressionContext(
        model=model,
        cache=cache,
        input_ids=pre.input_ids,
        attention_mask=pre.attention_mask,
        budget=Budget(tokens=pre.input_ids.shape[1]),
        tokenizer=tok,
    )
    build_method("am_highest_fast[chunking=text,chunks=3,queries=random]").compress(ctx)
    full = pre.cache.layers[0].padded()[0]
    ours = cache.layers[0].padded()[0]
    # transformers builds RoPE tables in float32, so phases agree to float32 rounding of the angles
    torch.testing.assert_close(ours, full, rtol=0, atol=1e-5)
    assert not torch.allclose(cache.layers[1].padded()[1], pre.cache.layers[1].padded()[1])  # no cross-chunk context


def test_greedy_swap_gives_budget_to_sensitive_heads():
    ratios = [0.025, 0.05, 0.1, 0.2, 0.4]
    r = torch.tensor(ratios, dtype=F64)
    sensitive = 1.0 / r  # loss falls steeply with more entries
    flat = 0.01 / r
    curves = torch.stack([sensitive, flat, flat, sensitive * 0.5])
    curves = curves - curves[:, 1:2]  # change relative to the base ratio 0.05
    shares = greedy_swap(curves, ratios, r0=0.05, eta=1 / 16)
    assert math.isclose(float(shares.sum()), 1.0)
    assert shares[0] >= shares[3] > shares[1] and torch.isclose(shares[1], shares[2])

    def predicted(p):  # Σ_h J_h(ρ_h) with the curves interpolated as Algorithm 4 sees them
        return float(_interp(curves, r, p * 4 * 0.05).sum())

    assert predicted(shares) < predicted(torch.full((4,), 0.25, dtype=F64))


def test_a_saved_head_schedule_round_trips(tmp_path):
    model = model64("llama")
    tok = CharTokenizer()
    schedule = build_head_schedule(
        model,
        tok,
        [TEXT * 2],
        tmp_path / "schedule.json",
        ratios=(0.1, 0.3),
        r0=0.2,
        continuation_tokens=8,
        method="am_highest_fast[queries=random]",
    )
    loaded = HeadSchedule.load(tmp_path / "schedule.json", model)
    assert loaded == schedule and loaded.config_hash == config_hash(model.config)
    assert len(loaded.curves) == 2 and len(loaded.curves[0][0]) == 2
    assert math.isclose(sum(sum(row) for row in loaded.shares), 1.0)
    # a hand-made schedule: the per-head budgets become real per-head lengths
    loaded.shares = [[0.4, 0.1], [0.3, 0.2]]
    loaded.save(tmp_path / "uneven.json")
    pre = kvfold.prefill(model, tok, TEXT * 2, use_chat_template=False)
    small = pre.compress(f"am_highest_fast[queries=random,schedule={tmp_path / 'uneven.json'}]", 0.2)
    budget = Budget.parse(0.2).count(pre.input_ids.shape[1])
    expected = HeadSchedule.load(tmp_path / "uneven.json").counts(
        torch.tensor([budget]), {i: layer.row_lengths() for i, layer in pre.cache.folded_layers}
    )
    for i, layer in small.cache.folded_layers:
        assert layer.row_lengths().tolist() == expected[i].tolist()
    assert sum(int(c.sum()) for c in expected.values()) == budget * 4
    other = kvfold.enable(make_tiny_model("qwen2").to(F64))
    with pytest.raises(ValueError, match="computed for"):
        HeadSchedule.load(tmp_path / "uneven.json", other)


# ---------------------------------------------------------------------------- queries, online, chunked prefill


def test_repeat_prefill_records_the_instruction_and_the_context_again():
    model = model64("llama")
    tok = CharTokenizer()
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(
        model=model,
        cache=pre.cache,
        input_ids=pre.input_ids,
        attention_mask=pre.attention_mask,
        budget=Budget.parse(0.5),
        tokenizer=tok,
    )
    row = pre.input_ids[0].tolist()
    (ids,) = RepeatPrompt.build(tok).chunk_inputs(row, 2048)  # KVzip's repeat pass, shared
    assert ids[-(len(row) - 1) :] == row[1:] and len(ids) > len(row) - 1  # instruction, then C (no BOS)
    queries = extract_reference_queries(ctx, QueryOptions(sources=("repeat",)))
    for _, q in queries.items():
        assert q.queries.shape[2] == 3 * len(ids)  # G = 3 query heads per KV head, every repeat token


def test_reference_queries_are_reused_across_budgets_of_one_context():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    first = pre.compress("am_highest_fast", 0.3)
    second = pre.compress("am_highest_fast", 0.2)
    assert "queries_reused" not in first.report["am"] and second.report["am"]["queries_reused"]
    assert second.report["reused_seconds"] > 0 and "reused_seconds" not in first.report
    assert second.compress_seconds >= second.report["reused_seconds"]  # reported as if run alone
    other = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False).compress("am_highest_fast", 0.2)
    assert "queries_reused" not in other.report["am"]
    for (_, a), (_, b) in zip(second.cache.folded_layers, other.cache.folded_layers, strict=True):
        torch.testing.assert_close(a.padded()[1], b.padded()[1], rtol=0, atol=1e-12)


def test_on_policy_queries_change_only_later_layers():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    off = pre.compress("am_highest_fast[max_queries=100000]", 0.3)
    on = pre.compress("am_highest_fast[max_queries=100000,on_policy=true]", 0.3)
    (_, off0), (_, off1) = off.cache.folded_layers
    (_, on0), (_, on1) = on.cache.folded_layers
    torch.testing.assert_close(on0.padded()[1], off0.padded()[1], rtol=0, atol=1e-10)
    assert not torch.allclose(on1.padded()[1], off1.padded()[1], atol=1e-6)


def test_online_compaction_keeps_the_cap_and_the_recent_tokens():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    method = build_method("am_highest_fast[online=true,recent=4,queries=random]")
    small = pre.compress(method, 20)
    cache = small.cache.copy()
    policy = small.policy
    cache.policy = policy
    token = pre.last_logits.argmax(-1)[:, None]
    start = pre.input_ids.shape[1]
    with torch.no_grad():
        for step in range(30):
            logits = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[start + step]])).logits
            token = logits[:, -1].argmax(-1)[:, None]
            for _, layer in cache.folded_layers:
                assert layer.physical_length <= 20
                assert layer.logical_length == start + step + 1
    assert min(policy.compactions.values()) >= 2
    beta = cache.folded_layers[0][1].padded()[2][0, 0]
    assert torch.equal(beta[-4:], torch.zeros(4, dtype=beta.dtype)) or policy.compactions[0] == 0


def test_chunked_prefill_compacts_between_chunks():
    model = model64("llama")
    tok = CharTokenizer()
    ids = torch.tensor([tok(TEXT * 2).input_ids])
    small = prefill_chunked(model, tok, ids, "am_highest_fast[queries=context]", 16, chunk_size=12)
    for _, layer in small.cache.folded_layers:
        assert layer.physical_length <= 16 + 12 and layer.logical_length == ids.shape[1]
    assert small.generate("why?", max_new_tokens=2, use_chat_template=False)[0].new_tokens >= 1


def test_am_fit_refits_the_kept_entries_only():
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False, methods=["am_fit"])
    base = pre.compress("streamingllm[online=false]", 0.3)
    fitted = pre.compress("streamingllm[online=false]+am_fit", 0.3)
    for (_, a), (_, b) in zip(base.cache.folded_layers, fitted.cache.folded_layers, strict=True):
        ka, va, _, la = a.padded()
        kb, vb, beta, lb = b.padded()
        assert torch.equal(ka, kb) and torch.equal(la, lb)
        assert not torch.allclose(va, vb) and float(beta.abs().max()) > 0.5
    if "snapkv" in REGISTRY:
        assert build_method("am_fit").spec == "am_fit" and build_method("am_fit").selector.name == "snapkv"


def test_bad_options_are_spec_errors():
    for spec in ("am_highest[queries=psychic]", "am_omp[span=a:b]", "am_omp_fast[k=0]", "am_highest[factor=2]"):
        with pytest.raises(SpecError):
            build_method(spec)


def test_layers_are_fitted_in_groups_of_bounded_query_bytes_with_the_same_result(monkeypatch):
    """``compact_layers`` stacks at most ``STACK_BYTES`` of reference queries at once (the stack
    copies them): ``am_highest_fast`` compacted one layer per group keeps the keys it keeps with
    every layer in one stack, with the same β and values up to the rounding of a batched solve of
    another size (the value fit is ill-conditioned on a random tiny model: 0.5% apart); the groups
    follow the bytes (a layer above the limit alone)."""
    from kvfold.methods.compaction.attention_matching import compact

    q = {i: torch.zeros(1, 2, n, 4) for i, n in enumerate([10, 10, 30, 5, 5])}  # 80, 80, 240, 40, 40 floats
    assert compact.layer_groups(q, 200 * 4) == [[0, 1], [2], [3, 4]]
    assert compact.layer_groups(q, 10**9) == [[0, 1, 2, 3, 4]]
    model = kvfold.enable(make_tiny_model("llama"))
    caches = []
    for limit in (10**12, 1):
        monkeypatch.setattr(compact, "STACK_BYTES", limit)
        pre = kvfold.prefill(model, CharTokenizer(), TEXT * 3, use_chat_template=False)
        caches.append(pre.compress("am_highest_fast", 0.3).cache)
    for (_, a), (_, b) in zip(caches[0].folded_layers, caches[1].folded_layers, strict=True):
        (k0, v0, b0, n0), (k1, v1, b1, n1) = a.padded(), b.padded()
        assert torch.equal(k0, k1) and torch.equal(n0, n1)
        torch.testing.assert_close(b0, b1, rtol=1e-3, atol=1e-3)
        assert float((v0 - v1).norm() / v0.norm()) < 0.02
