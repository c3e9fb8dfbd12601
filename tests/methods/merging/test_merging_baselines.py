"""CaM, D2O and KVMerger: merge rules on hand-computed examples, loop references, seeds, every family."""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.evaluate.diagnostics.mergemap import MergeRecorder
from kvfold.methods import CompressionContext, SpecError, build_method
from kvfold.methods.merging.cam import cam_merge, merge_sets
from kvfold.methods.merging.d2o import D2OMerge, attention_variance, d2o_merge, ema_thresholds, variance_layer_budgets
from kvfold.methods.merging.kvmerger import gaussian_merge, layer_joins, merging_sets
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from tests.conftest import FAMILIES, CharTokenizer, make_tiny_model

F64 = torch.float64
SPECS = ["cam", "snapkv+cam", "d2o", "snapkv+d2o_merge", "kvmerger"]


def model64(family: str = "llama", **overrides) -> torch.nn.Module:
    return kvfold.enable(make_tiny_model(family, **overrides).to(F64))


def prefill_cache(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> FoldedCache:
    cache = FoldedCache(model.config)
    cache.capture_window = 64
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    cache.capture_window = 0
    return cache


def compress(model, cache, ids, spec, budget, mask=None, seed=0, recorder=None) -> CompressionContext:
    ctx = CompressionContext(
        model=model,
        cache=cache,
        input_ids=ids,
        attention_mask=mask,
        budget=Budget.parse(budget),
        seed=seed,
        merge_recorder=recorder,
    )
    with torch.no_grad():
        build_method(spec).compress(ctx)
    return ctx


def kept_slots(full: FoldedLayer, small: FoldedLayer, b: int, h: int) -> list[int]:
    """Slots of the full layer whose (unchanged) keys the compressed row holds."""
    keys, _, _, lengths = small.padded()
    held = keys[b, h, : lengths[b, h]]
    match = (held[:, None, :] == full.padded()[0][b, h][None]).all(-1)
    assert bool((match.sum(-1) == 1).all())
    return match.double().argmax(-1).tolist()


def layer_of(keys: torch.Tensor, values: torch.Tensor) -> FoldedLayer:
    layer = FoldedLayer()
    layer.update(keys, values)
    return layer


# ---------------------------------------------------------------------------- CaM


def test_cam_merge_sets_follow_the_evicted_token():
    kept = torch.tensor([[[False, True, False, False, True, True, False]]])  # retained positions 1, 4, 5
    start, count = merge_sets(kept, kept.sum(-1), 2)
    # e=0 → {1, 4} (retained 0, 1); e=2, 3 → {4, 5} (1, 2); e=6 (nothing after) → the last two {4, 5}
    evicted = [0, 2, 3, 6]
    assert start[0, 0, evicted].tolist() == [0, 1, 1, 1]
    assert count[0, 0, evicted].tolist() == [2, 2, 2, 2]
    start, count = merge_sets(kept, kept.sum(-1), 5)  # fewer than m retained: all of them
    assert (start[0, 0, [0, 6]].tolist(), count[0, 0, [0, 6]].tolist()) == ([0, 0], [3, 3])


def test_cam_value_update_spreads_each_merged_value_over_its_set():
    values = torch.tensor([[[[10.0], [1.0], [6.0], [2.0], [3.0]]]], dtype=F64)  # positions 0..4
    kept = torch.tensor([[[False, True, False, True, True]]])
    merged = torch.tensor([[[True, False, True, False, False]]])
    start, count = merge_sets(kept, kept.sum(-1), 2)
    out = cam_merge(values[:, :, [1, 3, 4]], values, merged, start, count, 2)
    # v_0 = 10 → {1, 3}: +5 each; v_2 = 6 → {3, 4}: +3 each
    assert out[0, 0, :, 0].tolist() == [1 + 5, 2 + 5 + 3, 3 + 3]


def _reference_cam(full: FoldedLayer, kept, queries, scaling, window, merge, seed, layer_idx, h, mean=False):
    """CaM by loops for one KV head: p_e, seeded Bernoulli, v_e/|S_e| added to the next m retained."""
    keys, values, _, _ = full.padded()
    n = keys.shape[2]
    groups = queries.shape[1] // keys.shape[1]
    attention = torch.zeros(n, dtype=F64)
    for g in range(groups):
        for i in range(window):
            upto = n - window + i + 1
            q = queries[0, h * groups + g, -window + i]
            attention[:upto] += torch.softmax(keys[0, h, :upto] @ q * scaling, -1) / (window * groups)
    draws = torch.rand(
        keys.shape[1], n, generator=torch.Generator().manual_seed(seed * 1_000_003 + layer_idx), dtype=F64
    )
    reference = sum(attention[r] for r in kept) / len(kept) if mean else max(attention[r] for r in kept)
    expected = values[0, h, kept].clone()
    merged = 0
    for e in range(n):
        if e in kept or not draws[h, e] < min(1.0, attention[e] / reference):
            continue
        merged += 1
        after = [i for i, r in enumerate(kept) if r > e][:merge]
        group = after if after else list(range(max(0, len(kept) - merge), len(kept)))
        for i in group:
            expected[i] += values[0, h, e] / len(group)
    return expected, merged


@pytest.mark.parametrize("reference", ["max", "mean"])
def test_cam_matches_the_loop_reference_and_keeps_keys(reference):
    model = model64(initializer_range=0.2)  # peaked attention: merge probabilities well below 1
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = prefill_cache(model, ids)
    full = cache.copy()
    compress(model, cache, ids, f"snapkv[window=8]+cam[merge=3,window=8,reference={reference}]", 0.3, seed=3)
    merged_any = evicted_any = 0
    for layer_idx, small in cache.folded_layers:
        layer = full.layers[layer_idx]
        scaling = model.model.layers[layer_idx].self_attn.scaling
        for h in range(small.num_heads):
            kept = kept_slots(layer, small, 0, h)  # keys are untouched, so they identify the kept slots
            expected, merged = _reference_cam(
                layer, kept, layer.captured_queries, scaling, 8, 3, 3, layer_idx, h, mean=reference == "mean"
            )
            torch.testing.assert_close(small.padded()[1][0, h, : len(kept)], expected, rtol=0, atol=1e-12)
            merged_any += merged
            evicted_any += 40 - len(kept)
    assert 0 < merged_any < evicted_any  # the probability decides


def test_cam_is_seeded_and_draws_the_same_alone_or_in_a_batch():
    model = model64("qwen2")
    tok = CharTokenizer()
    contexts = ["cache merging keeps what eviction drops " * 2, "a shorter context"]
    batch = kvfold.prefill(model, tok, contexts, use_chat_template=False, methods="snapkv+cam")
    first = batch.compress("snapkv[window=8]+cam[window=8]", 0.4, seed=5)
    again = batch.compress("snapkv[window=8]+cam[window=8]", 0.4, seed=5)
    other = batch.compress("snapkv[window=8]+cam[window=8]", 0.4, seed=6)
    values = [[c.cache.layers[i].padded()[1] for i, _ in c.cache.folded_layers] for c in (first, again, other)]
    assert all(torch.equal(a, b) for a, b in zip(values[0], values[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(values[0], values[2], strict=True))
    for row, text in enumerate(contexts):
        alone = kvfold.prefill(model, tok, text, use_chat_template=False).compress(
            "snapkv[window=8]+cam[window=8]", 0.4, seed=5
        )
        for (_, layer), (_, single) in zip(first.cache.folded_layers, alone.cache.folded_layers, strict=True):
            _, values, _, lengths = layer.padded()
            n = int(lengths[row, 0])
            torch.testing.assert_close(values[row, :, :n], single.padded()[1][0, :, :n], rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------- D2O


def test_d2o_ema_threshold_by_hand():
    u = torch.tensor([[0.9, 0.5, 0.8, 0.7]], dtype=F64)
    valid = torch.ones_like(u, dtype=torch.bool)
    # τ_{-1} = mean = 0.725; τ_j = 0.5 u_j + 0.5 τ_{j−1}
    expected = [0.725, 0.8125, 0.65625, 0.728125]
    torch.testing.assert_close(ema_thresholds(u, valid, 0.5)[0], torch.tensor(expected, dtype=F64))
    assert (u >= ema_thresholds(u, valid, 0.5))[0].tolist() == [True, False, True, False]
    torch.testing.assert_close(ema_thresholds(u, valid, 0.0)[0], torch.full((4,), 0.725, dtype=F64))
    torch.testing.assert_close(ema_thresholds(u, valid, 1.0)[0, 1:], u[0, :-1])


def test_d2o_ema_threshold_matches_the_recursion_on_ragged_rows():
    u = torch.rand(3, 400, generator=torch.Generator().manual_seed(1), dtype=F64)
    valid = torch.arange(400)[None, :] < torch.tensor([[400], [250], [1]])
    got = ema_thresholds(u, valid, 0.05)
    for r in range(3):
        n = int(valid[r].sum())
        tau = float(u[r, :n].mean())
        for j in range(n):
            assert abs(float(got[r, j]) - tau) < 1e-9
            tau = 0.05 * float(u[r, j]) + 0.95 * tau


def test_d2o_weighted_average_by_hand():
    kept_keys = torch.tensor([[[[1.0, 0.0]]]], dtype=F64)
    kept_values = torch.tensor([[[[2.0, 0.0]]]], dtype=F64)
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=F64)
    values = torch.tensor([[[[2.0, 0.0], [0.0, 4.0]]]], dtype=F64)
    merged = torch.tensor([[[False, True]]])
    carrier = torch.zeros(1, 1, 2, dtype=torch.long)
    similarity = torch.tensor([[[1.0, 0.0]]], dtype=F64)  # u = cos = 0 for the evicted one
    k, v, mass = d2o_merge(kept_keys, kept_values, keys, values, merged, carrier, similarity)
    e = math.e  # w_c = e/(e+1), w_e = exp(0)/(e+1)
    torch.testing.assert_close(k[0, 0, 0], torch.tensor([e / (e + 1), 1 / (e + 1)], dtype=F64))
    torch.testing.assert_close(v[0, 0, 0], torch.tensor([2 * e / (e + 1), 4 / (e + 1)], dtype=F64))
    assert float(mass) == pytest.approx((e + 1) / e)
    k, v, mass = d2o_merge(kept_keys, kept_values, keys, values, merged, carrier, similarity, "count")
    assert v[0, 0, 0].tolist() == [1.0, 2.0] and float(mass) == 2.0  # plain mean, count 2


def test_d2o_merge_folder_on_a_constructed_layer():
    keys = torch.tensor([[[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]]]], dtype=F64)
    values = torch.arange(10, dtype=F64).view(1, 1, 5, 2)
    layer = layer_of(keys, values)
    recorder = MergeRecorder()
    ctx = CompressionContext(
        model=None,
        cache=None,
        input_ids=torch.zeros(1, 5, dtype=torch.long),
        attention_mask=None,
        budget=Budget.parse(2),
        merge_recorder=recorder,
    )
    D2OMerge(ema=0.5, log_mass=True).fold(0, layer, torch.tensor([[[0, 2]]]), torch.tensor([[2]]), None, ctx)
    # u = (cos to 0, cos to 2, 0): τ_{-1} = 0.6626 → merge 1 → τ_0 = 0.828 → merge 3 → τ_1 = 0.911 → 4 evicted
    u = 0.9 / math.hypot(0.9, 0.1)
    w = math.exp(u) / (math.e + math.exp(u))
    new_keys, new_values, beta, lengths = layer.padded()
    assert lengths.tolist() == [[2]]
    torch.testing.assert_close(new_keys[0, 0, 0], (1 - w) * keys[0, 0, 0] + w * keys[0, 0, 1])
    torch.testing.assert_close(new_values[0, 0, 1], (1 - w) * values[0, 0, 2] + w * values[0, 0, 3])
    torch.testing.assert_close(beta[0, 0], torch.full((2,), math.log(1 + math.exp(u - 1)), dtype=torch.float32))
    carrier, absorbed, _ = recorder.pairs[0][0]
    pairs = {(int(c), int(a)) for c, a in zip(carrier.flatten(), absorbed.flatten(), strict=True) if a >= 0}
    assert pairs == {(0, 1), (2, 3)}


def test_d2o_layer_budgets_follow_inverse_variance():
    assert variance_layer_budgets([1.0, 2.0, 4.0], 70, 1000, min_ratio=0.0) == [120, 60, 30]
    capped = variance_layer_budgets([1.0, 2.0, 4.0], 70, 100, min_ratio=0.5)  # layer 0 capped at N
    assert sum(capped) == 210 and capped[0] == 100 and min(capped) >= 35
    uniform = torch.full((1, 2, 3, 4), 0.25, dtype=F64)
    one_hot = torch.zeros(1, 2, 3, 4, dtype=F64)
    one_hot[..., 1] = 1.0
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    assert float(attention_variance(uniform, valid)) == pytest.approx(0.0)
    assert float(attention_variance(one_hot, valid)) == pytest.approx(1 / 4 - 1 / 16)


def test_d2o_keeps_each_layer_budget_and_its_sinks():
    model = model64(initializer_range=0.2, num_hidden_layers=4)
    ids = torch.randint(2, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    cache = prefill_cache(model, ids)
    recorder = MergeRecorder()
    ctx = compress(model, cache, ids, "d2o[window=8,min_ratio=0.5]", 0.25, recorder=recorder)
    budgets = ctx.report["d2o"]["layer_budgets"]
    assert sum(b[0] for b in budgets) == 12 * len(budgets) and len({b[0] for b in budgets}) > 1
    for (layer_idx, small), budget in zip(cache.folded_layers, budgets, strict=True):
        assert small.row_lengths().tolist() == [[budget[0]] * small.num_heads]
        keep, _ = recorder.kept_slots[layer_idx]
        assert all({0, 1, 2, 3} <= set(row) for row in keep[0].tolist())  # the 4 sinks
        assert ctx.report["d2o"][layer_idx]["merged"] > 0


# ---------------------------------------------------------------------------- KVMerger


def test_kvmerger_sets_pivots_and_gaussian_weights_by_hand():
    join = torch.tensor([[[True, False, True, True]]])  # sets {0, 1}, {2, 3, 4}
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    scores = torch.tensor([[[0.1, 0.3, 0.2, 0.5, 0.5]]], dtype=F64)
    set_id, count, pivot = merging_sets(join, valid, scores)
    assert set_id.tolist() == [[[0, 0, 1, 1, 1]]] and count.tolist() == [[2]] and pivot.tolist() == [[[1, 3]]]
    keys = torch.tensor([[[[2.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 3.0]]]], dtype=F64)
    k, v, weight = gaussian_merge(keys, keys * 10, set_id, pivot, sigma=1.0)
    w = math.exp(-4 / 2)  # ‖k_0 − k_1‖² = 4, σ = 1
    torch.testing.assert_close(k[0, 0, 0], torch.tensor([2 * w / (1 + w), 0.0], dtype=F64))
    torch.testing.assert_close(v[0, 0, 0], 10 * k[0, 0, 0])
    torch.testing.assert_close(weight[0, 0, :2], torch.tensor([w / (1 + w), 1 / (1 + w)], dtype=F64))
    _, _, weight = gaussian_merge(keys, keys, set_id, pivot)  # σ² = RMS distance² to the pivot
    w2, w4 = math.exp(-1 / (2 * 5)), math.exp(-9 / (2 * 5))  # set 2: d² = 1, 9 → σ² = 5
    torch.testing.assert_close(weight[0, 0, 2:], torch.tensor([w2, 1.0, w4], dtype=F64) / (1 + w2 + w4))


def test_kvmerger_per_layer_threshold_joins_the_most_similar_pairs():
    similarity = torch.tensor([[[0.9, 0.2, 0.8], [0.95, 0.5, 0.1]]], dtype=F64)
    joinable = torch.tensor([[[True, True, True], [False, True, True]]])
    join, threshold = layer_joins(similarity, joinable, torch.tensor([3]))
    assert join.tolist() == [[[True, False, True], [False, True, False]]]  # 0.95 is not joinable
    assert threshold.tolist() == [0.5]
    join, _ = layer_joins(similarity, joinable, torch.tensor([3]), floor=0.6)
    assert int(join.sum()) == 2


def test_kvmerger_meets_the_budget_per_layer_with_per_head_lengths():
    model = model64()
    ids = torch.randint(2, 97, (1, 48), generator=torch.Generator().manual_seed(4))
    cache = prefill_cache(model, ids)
    full = cache.copy()
    recorder = MergeRecorder()
    ctx = compress(model, cache, ids, "kvmerger[window=4,sinks=2]", 0.25, recorder=recorder)
    for layer_idx, small in cache.folded_layers:
        lengths = small.row_lengths()
        assert int(lengths.sum()) == 12 * small.num_heads
        keys0, values0, _, _ = full.layers[layer_idx].padded()
        keys1 = small.padded()[0]
        carrier, absorbed, _ = recorder.pairs[layer_idx][0]
        for h in range(small.num_heads):
            sets: dict[int, list[int]] = {}
            for c, a in zip(carrier[0, h].tolist(), absorbed[0, h].tolist(), strict=True):
                sets.setdefault(c, [c])
                if a >= 0:
                    sets[c].append(a)
            assert len(sets) == int(lengths[0, h])
            for pivot, members in sets.items():
                members = sorted(members)
                assert members == list(range(members[0], members[-1] + 1))  # consecutive tokens
                if len(members) == 1:
                    continue
                assert members[0] >= 2 and members[-1] < 44  # sinks and window are never merged
                d2 = ((keys0[0, h, members] - keys0[0, h, pivot]) ** 2).sum(-1)
                w = torch.exp(-d2 / (2 * d2.sum() / (len(members) - 1)))
                merged = (w[:, None] * keys0[0, h, members]).sum(0) / w.sum()
                slot = sorted(sets).index(pivot)
                torch.testing.assert_close(keys1[0, h, slot], merged)
        # one threshold per layer: every joined neighbour pair is at least as similar as every other
        similarity = torch.nn.functional.cosine_similarity(keys0[0, :, :-1], keys0[0, :, 1:], dim=-1)
        joined = torch.zeros_like(similarity, dtype=torch.bool)
        for h in range(small.num_heads):
            for c, a in zip(carrier[0, h].tolist(), absorbed[0, h].tolist(), strict=True):
                if a >= 0:
                    joined[h, min(a, c) : max(a, c)] = True
        joinable = torch.zeros_like(joined)
        joinable[:, 2:43] = True  # pairs (i, i+1) with both tokens outside the sinks and the window
        assert float(similarity[joined].min()) >= float(similarity[joinable & ~joined].max())
        assert ctx.report["kvmerger"][layer_idx]["threshold"][0] == pytest.approx(float(similarity[joined].min()))
    assert cache.nbytes() < full.nbytes()


# ---------------------------------------------------------------------------- all of them


def test_spec_errors_and_bare_names():
    assert build_method("cam").selector.name == "streamingllm" and not build_method("cam").selector.online
    assert build_method("snapkv+cam").folder.merge == 16
    with pytest.raises(SpecError, match="d2o_merge"):
        build_method("d2o_merge")
    with pytest.raises(SpecError, match="weighting"):
        build_method("snapkv+d2o_merge[weighting=mean]")
    with pytest.raises(SpecError, match="sigma"):
        build_method("kvmerger[sigma=0]")
    with pytest.raises(SpecError, match="merge"):
        build_method("cam[merge=0]")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_merging_method_runs_on_every_family_and_a_padded_batch(family):
    model = kvfold.enable(make_tiny_model(family))
    tok = CharTokenizer()
    contexts = ["merging baselines run on every family, " * 3, "and on left-padded batches"]
    prefilled = kvfold.prefill(model, tok, contexts, use_chat_template=False, methods=SPECS)
    specs = [*SPECS, "adakv:snapkv+cam"] if family == "llama" else SPECS
    for spec in specs:
        compressed = prefilled.compress(spec, 0.3)
        assert compressed.kv_bytes < compressed.kv_bytes_full, (family, spec)
        answers = compressed.generate("why?", max_new_tokens=2, use_chat_template=False)
        assert len(answers) == 2 and all(a.new_tokens >= 1 for a in answers), (family, spec)
