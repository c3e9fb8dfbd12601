"""The merge-map diagnostic: what each method records, the files, and a recorded compression."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold.evaluate.diagnostics.mergemap import merge_maps
from tests.conftest import make_tiny_model
from tests.evaluate.conftest import CharTokenizer

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4


def test_merge_maps_record_every_method_and_write_the_files(tmp_path: Path):
    model = kvfold.enable(make_tiny_model("llama", initializer_range=0.2))
    tok = CharTokenizer()
    specs = [
        "snapkv[window=8]",
        "snapkv[window=8]+d2o_merge",
        "snapkv[window=8]+cam[window=8]",
        "snapkv[window=8]+grkv[m=8]",
    ]
    prefilled = kvfold.prefill(model, tok, [TEXT, TEXT[:90]], use_chat_template=False, methods=specs)
    result = merge_maps(prefilled, specs, 0.3, layer=1, out_dir=tmp_path, run_config={"model": "tiny"})
    for name in ("mergemap.json", "mergemap.md", "mergemap.png", "carrier_load.png"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "mergemap.json").read_text())
    assert saved["config"]["layer"] == 1 and [r["method"] for r in saved["records"]] == specs
    by = {r["method"]: r for r in result.records}
    evict, d2o, cam, grkv = (by[s]["summary"] for s in specs)
    assert all(r["recorded"] for r in result.records)
    assert evict["absorbed"] == 0 and evict["updated"] == 0 and evict["gini"] is None
    assert d2o["absorbed"] > 0 and 0 < d2o["merged_fraction"] < 1 and d2o["dk_rel_mean"] > 0
    assert cam["absorbed"] > 0 and cam["dk_rel_mean"] == 0 and cam["dv_rel_mean"] > 0  # CaM leaves keys alone
    assert grkv["absorbed"] == 0 and grkv["updated"] > 0 and grkv["dv_gini"] is not None
    drawn = result.plot["maps"]
    d2o_map, cam_map = drawn[specs[1]], drawn[specs[2]]
    absorbed = [p[1] for p in d2o_map["pairs"]]
    assert len(absorbed) == len(set(absorbed))  # one carrier per absorbed token
    assert set(p[0] for p in d2o_map["pairs"]) <= set(d2o_map["retained"])
    assert not set(absorbed) & set(d2o_map["retained"])
    shares: dict[int, float] = {}
    for _, token, share, _ in cam_map["pairs"]:
        shares[token] = shares.get(token, 0.0) + share
    assert all(s == pytest.approx(1.0) for s in shares.values())  # v_e spread in full over its merge set
    assert "| `snapkv[window=8]+cam[window=8]` |" in (tmp_path / "mergemap.md").read_text()
    silent = merge_maps(prefilled, ["full"], 0.3, out_dir=tmp_path / "silent")  # marked, not dropped
    assert "records no merge map" in (tmp_path / "silent" / "mergemap.md").read_text()
    assert not silent.records[0]["recorded"] and silent.plot["maps"]["full"] == "unrecorded"


def test_zsmerge_merge_map_names_slot_founders_as_carriers(tmp_path: Path):
    """Algorithm 1 (ZSMerge §3.2): the first victim opens a residual slot and later victims join it,
    so every absorbed token's carrier is a slot founder, and founders + absorbed = Σ w per head."""
    model = kvfold.enable(make_tiny_model("llama", initializer_range=0.2))
    tok = CharTokenizer()
    spec = "zsmerge[residual=0.25]"
    prefilled = kvfold.prefill(model, tok, [TEXT, TEXT[:90]], use_chat_template=False, methods=[spec])
    result = merge_maps(prefilled, [spec], 0.3, layer=1, out_dir=tmp_path)
    record = result.records[0]
    assert record["recorded"] and record["summary"]["absorbed"] > 0
    drawn = result.plot["maps"][spec]
    carriers = {p[0] for p in drawn["pairs"]}
    absorbed = [p[1] for p in drawn["pairs"]]
    assert carriers <= set(drawn["retained"]) and not set(absorbed) & set(drawn["retained"])
    assert len(absorbed) == len(set(absorbed))
    compressed = prefilled.compress(spec, 0.3)
    layer = dict(compressed.cache.folded_layers)[1]
    _, _, log_mass, _ = layer.padded()
    w = log_mass[0, 0].exp()[torch.isfinite(log_mass[0, 0])]  # α = 1: β = log w, plain tokens w = 1
    assert len(absorbed) == round(float(w.sum()) - w.numel())  # each join adds one to some slot's w


def test_a_recorded_compression_reuses_the_repeat_pass_and_equals_compress(monkeypatch):
    """``compress_recorded`` shares KVzip's repeat pass with the context's other compressions, and
    records the cache that :meth:`PrefilledContext.compress` makes, slot for slot."""
    from kvfold.evaluate.diagnostics.mergemap import compress_recorded
    from kvfold.methods.core import repeat

    model = kvfold.enable(make_tiny_model("llama"))
    calls = []
    real = repeat.repeat_pass
    monkeypatch.setattr(repeat, "repeat_pass", lambda ctx, chunk, **kw: calls.append(chunk) or real(ctx, chunk, **kw))
    context = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    plain = context.compress("kvzip", 0.3)
    recorded, recorder, _ = compress_recorded(context, "kvzip+keepkv", 0.3)
    assert len(calls) == 1
    folded = context.compress("kvzip+keepkv", 0.3)
    for (i, a), (_, b) in zip(recorded.folded_layers, folded.cache.folded_layers, strict=True):
        torch.testing.assert_close(a.padded()[1], b.padded()[1], rtol=0, atol=0)
        keep, lengths = recorder.kept_slots[i]
        assert torch.equal(lengths, plain.cache.layers[i].padded()[3].cpu())
