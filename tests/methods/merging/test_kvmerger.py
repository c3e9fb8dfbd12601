"""KVMerger as a folder (``SELECTOR+kvmerger``): merging sets, carriers, Gaussian merge, names, merge map."""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.evaluate.diagnostics.mergemap import compress_recorded, merge_maps
from kvfold.methods import SpecError, build_method
from kvfold.methods.merging.kvmerger import KVMerger, KVMergerSets, kept_carriers, kvmerger_fold, similar_runs
from tests.conftest import CharTokenizer, make_tiny_model

F64 = torch.float64

# Twelve 2-D keys, merging sets at threshold 0.8: {0, 1, 2}, {3}, {4, 5}, {6, 7}, {8, 9, 10, 11}.
KEYS = torch.tensor(
    [
        [1.0, 0.0],
        [2.0, 0.2],
        [1.0, 0.1],
        [0.0, 1.0],
        [-1.0, 0.0],
        [-2.0, 0.5],
        [0.0, -1.0],
        [0.1, -2.0],
        [1.0, 1.0],
        [1.2, 1.0],
        [1.0, 1.3],
        [1.1, 1.0],
    ],
    dtype=F64,
)[None, None]
SETS = [0, 0, 0, 1, 2, 2, 3, 3, 4, 4, 4, 4]
KEEP = [1, 3, 5, 8, 11]  # set {6, 7} keeps nothing; set {8, …, 11} keeps two members
ATTENTION = torch.tensor([[[0.1, 0.2, 0.1, 0.3, 0.1, 0.2, 0.9, 0.9, 0.2, 0.1, 0.1, 0.4]]], dtype=F64)


def run_fold(keys, keep, attention, threshold=0.8, sigma=None, carrier="pivot", log_mass_sum=False, log_mass=None):
    batch, heads = keys.shape[:2]
    keep_t = torch.tensor(keep).expand(batch, heads, -1)
    lengths = torch.full((batch, heads), len(keep))
    values = 10 * keys + 1
    beta = torch.zeros(keys.shape[:3]) if log_mass is None else log_mass
    out = kvmerger_fold(keys, values, beta, keep_t, lengths, attention, threshold, sigma, carrier, log_mass_sum)
    return values, out


def reference(keys, values, carriers: dict[int, list[int]], sigma=None):
    """Loops: every carrier's Gaussian-kernel average with the tokens it absorbs (own weight 1)."""
    out_k, out_v = [], []
    for c, absorbed in carriers.items():
        members = [c, *absorbed]
        d2 = [float(((keys[0, 0, i] - keys[0, 0, c]) ** 2).sum()) for i in members]
        var = sigma**2 if sigma is not None else (sum(d2) / len(absorbed) if absorbed else 0.0)
        w = [1.0 if var == 0 else math.exp(-d / (2 * var)) for d in d2]
        out_k.append(sum(wi * keys[0, 0, i] for wi, i in zip(w, members, strict=True)) / sum(w))
        out_v.append(sum(wi * values[0, 0, i] for wi, i in zip(w, members, strict=True)) / sum(w))
    return torch.stack(out_k), torch.stack(out_v)


def test_merging_sets_and_carriers_by_hand():
    valid = torch.ones(1, 1, 12, dtype=torch.bool)
    set_id = similar_runs(KEYS, valid, 0.8)
    assert set_id[0, 0].tolist() == SETS
    kept = torch.zeros(1, 1, 12, dtype=torch.bool)
    kept[..., KEEP] = True
    pivot = kept_carriers(set_id, kept, ATTENTION, "pivot")[0, 0].tolist()
    # {8..11}: 11 has more attention than 8, so it is the pivot of 9 and 10; kept tokens carry themselves
    assert pivot == [1, 1, 1, 3, 5, 5, -1, -1, 8, 11, 11, 11]
    nearest = kept_carriers(set_id, kept, ATTENTION, "nearest")[0, 0].tolist()
    assert nearest == [1, 1, 1, 3, 5, 5, -1, -1, 8, 8, 11, 11]
    both = kept[..., :11] | (torch.arange(11) == 10)  # 9 lies as far from kept 8 as from kept 10
    tie = kept_carriers(set_id[..., :11], both, ATTENTION[..., :11], "nearest")
    assert tie[0, 0, 9].item() == 8  # A_8 = 0.2 > A_10 = 0.1
    louder = ATTENTION[..., :11].clone()
    louder[..., 10] = 0.5
    assert kept_carriers(set_id[..., :11], both, louder, "nearest")[0, 0, 9].item() == 10
    padded = similar_runs(KEYS, valid & (torch.arange(12) >= 2), 0.8)
    assert padded[0, 0].tolist() == [-1, -1, 0, 1, 2, 2, 3, 3, 4, 4, 4, 4]


def test_gaussian_merge_into_the_kept_pivot_by_hand():
    values, (k, v, beta, carrier, merged) = run_fold(KEYS, KEEP, ATTENTION, sigma=1.0)
    # carrier 5 absorbs 4: ‖k_4 − k_5‖² = 1 + 0.25, σ = 1 → w_4 = exp(−0.625), w_5 = 1
    w = math.exp(-1.25 / 2)
    torch.testing.assert_close(k[0, 0, 2], (KEYS[0, 0, 5] + w * KEYS[0, 0, 4]) / (1 + w))
    torch.testing.assert_close(v[0, 0, 2], (values[0, 0, 5] + w * values[0, 0, 4]) / (1 + w))
    carriers = {1: [0, 2], 3: [], 5: [4], 8: [], 11: [9, 10]}
    ref_k, ref_v = reference(KEYS, values, carriers, sigma=1.0)
    torch.testing.assert_close(k[0, 0], ref_k)
    torch.testing.assert_close(v[0, 0], ref_v)
    assert merged[0, 0].tolist() == [i in (0, 2, 4, 9, 10) for i in range(12)]  # 6, 7: their set keeps nothing
    assert carrier[0, 0].tolist() == [1, -1, 1, -1, 5, -1, -1, -1, -1, 11, 11, -1]
    assert beta.tolist() == [[[0.0] * 5]]  # log_mass off: β unchanged
    values, (k, v, beta, _, _) = run_fold(KEYS, KEEP, ATTENTION, carrier="nearest", log_mass_sum=True)
    carriers = {1: [0, 2], 3: [], 5: [4], 8: [9], 11: [10]}
    ref_k, ref_v = reference(KEYS, values, carriers)  # σ² per carrier: mean ‖k_e − k_c‖² of what it absorbs
    torch.testing.assert_close(k[0, 0], ref_k)
    torch.testing.assert_close(v[0, 0], ref_v)
    torch.testing.assert_close(beta[0, 0], torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0]).log())  # log Σ exp 0


def test_kept_entries_are_untouched_when_no_neighbour_is_similar():
    n = 10
    keys = torch.zeros(1, 2, n, 4, dtype=torch.float32)
    for i in range(n):
        keys[:, :, i, i % 2] = 1.0 + i  # neighbours orthogonal: cos = 0
        keys[:, 1, i, 2] = 0.5
    attention = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(0))
    beta = torch.randn(1, 2, n, generator=torch.Generator().manual_seed(1))
    keep = [0, 3, 4, 8]
    values, (k, v, out_beta, carrier, merged) = run_fold(keys, keep, attention, log_mass_sum=True, log_mass=beta)
    assert not merged.any() and bool((carrier == -1).all())
    assert torch.equal(k, keys[:, :, keep]) and torch.equal(v, values[:, :, keep])
    assert torch.equal(out_beta, beta[:, :, keep])
    # threshold −1 joins everything: each row is one set, every evicted token merges
    _, (_, _, _, carrier, merged) = run_fold(keys, keep, attention, threshold=-1.0)
    assert int(merged.sum()) == 2 * (n - len(keep))


def test_names_options_and_errors():
    bare = build_method("kvmerger[sigma=2,sinks=1]")
    assert isinstance(bare.selector, KVMergerSets) and bare.folder is None  # today's standalone policy
    assert bare.selector.sigma == 2.0 and bare.selector.sinks == 1
    assert isinstance(build_method("kvmerger_sets").selector, KVMergerSets)
    folded = build_method("snapkv[window=8]+kvmerger[threshold=0.5,carrier=nearest,window=8]")
    assert isinstance(folded.folder, KVMerger) and folded.selector.name == "snapkv"
    assert (folded.folder.threshold, folded.folder.carrier, folded.query_window) == (0.5, "nearest", 8)
    assert build_method("h2o[online=false]+kvmerger").folder.threshold == 0.8
    with pytest.raises(SpecError, match="kvmerger_sets.*no option.*carrier.*snapkv\\+kvmerger"):
        build_method("kvmerger[carrier=nearest]")
    with pytest.raises(SpecError, match="carrier must be one of pivot, nearest"):
        build_method("snapkv+kvmerger[carrier=first]")
    with pytest.raises(SpecError, match="threshold is a cosine"):
        build_method("snapkv+kvmerger[threshold=1.5]")
    with pytest.raises(SpecError, match="sigma"):
        build_method("snapkv+kvmerger[sigma=0]")
    with pytest.raises(SpecError, match="complete method"):
        build_method("adakv:kvmerger")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_snapkv_kvmerger_on_tiny_models_with_a_padded_batch(family):
    model = kvfold.enable(make_tiny_model(family))
    tok = CharTokenizer()
    contexts = ["the kvmerger folder merges runs of similar keys, " * 2, "and left-padded rows too"]
    spec = "snapkv[window=8]+kvmerger[window=8,threshold=0.2]"
    prefilled = kvfold.prefill(model, tok, contexts, use_chat_template=False, methods=[spec, "snapkv+kvmerger"])
    plain, _, _ = compress_recorded(prefilled, "snapkv[window=8]", 0.3)
    cache, recorder, report = compress_recorded(prefilled, spec, 0.3)
    pads = (prefilled.input_ids.shape[1] - prefilled.attention_mask.sum(-1)).tolist()
    total = 0
    for layer_idx, full in prefilled.cache.folded_layers:
        keys, values, _, _ = full.padded()
        small_keys, small_values, _, lengths = cache.layers[layer_idx].padded()
        plain_keys, plain_values, _, plain_lengths = plain.layers[layer_idx].padded()
        assert torch.equal(lengths, plain_lengths)  # the selector decides what is kept
        keep, _ = recorder.kept_slots[layer_idx]
        ((carrier, absorbed, share),) = recorder.pairs[layer_idx]
        assert bool((share == 1).all())
        total += int((absorbed >= 0).sum())
        assert report["kvmerger"][layer_idx]["merged"] == int((absorbed >= 0).sum())
        unit = torch.nn.functional.normalize(keys, dim=-1)
        similarity = (unit[..., :-1, :] * unit[..., 1:, :]).sum(-1)
        for b in range(keys.shape[0]):
            for h in range(keys.shape[1]):
                slots = keep[b, h, : lengths[b, h]].tolist()
                groups = {c: [] for c in slots}
                for c, a in zip(carrier[b, h].tolist(), absorbed[b, h].tolist(), strict=True):
                    if a >= 0:
                        assert a >= pads[b] and a not in groups and c in groups
                        lo, hi = min(a, c), max(a, c)
                        assert bool((similarity[b, h, lo:hi] >= 0.2).all())  # one run of similar keys
                        groups[c].append(a)
                for slot, (c, group) in enumerate(groups.items()):
                    if not group:  # a carrier that absorbed nothing is exactly what SnapKV keeps
                        assert torch.equal(small_keys[b, h, slot], plain_keys[b, h, slot])
                        assert torch.equal(small_values[b, h, slot], plain_values[b, h, slot])
                        continue
                    d2 = ((keys[b, h, [c, *group]] - keys[b, h, c]) ** 2).sum(-1)
                    w = torch.exp(-d2 / (2 * d2.sum() / len(group)))
                    merged_k = (w[:, None] * keys[b, h, [c, *group]]).sum(0) / w.sum()
                    merged_v = (w[:, None] * values[b, h, [c, *group]]).sum(0) / w.sum()
                    torch.testing.assert_close(small_keys[b, h, slot], merged_k)
                    torch.testing.assert_close(small_values[b, h, slot], merged_v)
    assert total > 0
    for chosen in (spec, "snapkv+kvmerger"):
        compressed = prefilled.compress(chosen, 0.3)
        assert compressed.kv_bytes < compressed.kv_bytes_full
        answers = compressed.generate("why?", max_new_tokens=2, use_chat_template=False)
        assert len(answers) == 2 and all(a.new_tokens >= 1 for a in answers)
    result = merge_maps(prefilled, [spec], 0.3, layer=1)
    summary = result.records[0]["summary"]
    assert result.records[0]["recorded"] and summary["absorbed"] > 0 and summary["dk_rel_mean"] > 0
    pairs = result.plot["maps"][spec]["pairs"]
    assert len({p[1] for p in pairs}) == len(pairs)  # one carrier per absorbed token
