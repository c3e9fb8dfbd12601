"""Fidelity on a tiny random model: full is exact, eviction errors grow as the budget shrinks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvfold.evaluate import Sample, fidelity
from kvfold.evaluate.running.fidelity_measures import block_outputs, decode_schedule, reference_answer

CONTEXT = "The quick brown fox jumps over the lazy dog near the river bank at dawn. " * 4


def _samples() -> list[Sample]:
    return [
        Sample(CONTEXT, "\nWhat jumps?", ("the brown fox",), "qa", "Answer:", sample_id="q1"),
        Sample(CONTEXT, "\nWhere?", ("river", "bank"), "qa", "Answer:", sample_id="q2"),
    ]


def test_full_is_exact_and_eviction_error_grows(tiny_lm, tmp_path: Path) -> None:
    model, tok = tiny_lm
    result = fidelity(model, tok, _samples(), ["full", "streamingllm"], [0.9, 0.3], out_dir=tmp_path, progress=False)
    by_run = {(r["method"], r["budget"]): r for r in result.records}
    assert set(by_run) == {("full", 1.0), ("streamingllm", 0.9), ("streamingllm", 0.3)}
    full = by_run[("full", 1.0)]
    assert full["rel_error"] <= 1e-5
    assert full["nll_delta"] == pytest.approx(0.0, abs=1e-6) and full["kl"] == pytest.approx(0.0, abs=1e-6)
    mild, strong = by_run[("streamingllm", 0.9)], by_run[("streamingllm", 0.3)]
    assert 0 < mild["rel_error"] < strong["rel_error"]
    assert mild["kl"] < strong["kl"]
    assert full["block_error"] <= 1e-12 and 0 < mild["block_error"] < strong["block_error"]
    assert len(strong["per_layer"]) == len(strong["block_per_layer"]) == model.config.num_hidden_layers
    assert strong["n"] == 2
    assert strong["kv_ratio"] == pytest.approx(0.3, abs=0.02)
    saved = json.loads((tmp_path / "fidelity.json").read_text())
    assert {"method", "budget", "rel_error", "nll_delta", "per_layer"} <= set(saved["records"][0])
    assert (tmp_path / "fidelity.md").exists() and (tmp_path / "fidelity.png").read_bytes()[:4] == b"\x89PNG"


def test_online_policy_is_off_and_hooks_are_removed(tiny_lm) -> None:
    model, tok = tiny_lm
    result = fidelity(model, tok, _samples()[:1], ["streamingllm", "streamingllm[online=0]"], [0.3], progress=False)
    online, offline = result.records
    assert online["rel_error"] == offline["rel_error"] and online["nll_delta"] == offline["nll_delta"]
    assert all(not m.o_proj._forward_pre_hooks for m in model.modules() if hasattr(m, "o_proj"))


def test_next_tokens_continuation(tiny_lm) -> None:
    model, tok = tiny_lm
    result = fidelity(
        model, tok, _samples(), ["full", "streamingllm"], [0.5], continuation="next", next_tokens=24, progress=False
    )
    assert [r["n"] for r in result.records] == [1, 1]  # both samples share one document
    assert result.records[0]["rel_error"] == 0.0 and result.records[1]["rel_error"] > 0
    assert result.samples[0]["continuation_tokens"] == 24 and result.samples[0]["scored_tokens"] == 23
    with pytest.raises(ValueError, match="too few to hold out"):
        fidelity(model, tok, _samples(), ["full"], [0.5], continuation="next", next_tokens=400, progress=False)
    with pytest.raises(ValueError, match="'answer' or 'next'"):
        fidelity(model, tok, _samples(), ["full"], [0.5], continuation="doc", progress=False)


def test_reference_answer() -> None:
    one, all_of = _samples()
    assert reference_answer(one) == " the brown fox"
    assert reference_answer(all_of) == " river, bank"
    part = Sample("c", "q", ("x", "y"), "t", metric="string_match_part")
    assert reference_answer(part) == "x"


def test_block_outputs_read_beta_and_gqa_groups() -> None:
    torch.manual_seed(0)
    h_q, h_kv, d, q_len = 4, 2, 8, 3
    keys, values = torch.randn(h_kv, 5, d), torch.randn(h_kv, 5, d)
    queries = torch.randn(h_q, q_len, d)
    full = (keys.double(), values.double(), torch.zeros(h_kv, 5, dtype=torch.float64))
    out = block_outputs(queries, full, 0.3)
    for head in range(h_q):  # query head h reads KV head h // (h_q / h_kv)
        kv = head // (h_q // h_kv)
        probs = torch.softmax(queries[head].double() @ keys[kv].double().T * 0.3, dim=-1)
        torch.testing.assert_close(out[head], probs @ values[kv].double())
    # a duplicated entry folded into one with β = log 2 gives the same block output
    dup_k, dup_v = torch.cat([keys, keys[:, -1:]], 1), torch.cat([values, values[:, -1:]], 1)
    with_dup = (dup_k.double(), dup_v.double(), torch.zeros(h_kv, 6, dtype=torch.float64))
    folded_beta = torch.zeros(h_kv, 5, dtype=torch.float64)
    folded_beta[:, -1] = math.log(2.0)
    folded = (keys.double(), values.double(), folded_beta)
    torch.testing.assert_close(block_outputs(queries, with_dup, 0.3), block_outputs(queries, folded, 0.3))
    empty = torch.full((h_kv, 1), -math.inf, dtype=torch.float64)  # an empty slot changes nothing
    padded = (dup_k[:, :6].double(), dup_v[:, :6].double(), torch.cat([folded_beta, empty], 1))
    torch.testing.assert_close(block_outputs(queries, padded, 0.3), block_outputs(queries, folded, 0.3))


def test_decode_schedule_feeds_the_prompt_whole_and_then_one_token_a_forward() -> None:
    assert decode_schedule([False, False, True, True, True], online=False) == [5]
    assert decode_schedule([False, False, True, True, True], online=True) == [2, 1, 1, 1]
    assert decode_schedule([True, True], online=True) == [1, 1]
    assert decode_schedule([False, True], online=True) == [1, 1]


def test_online_runs_the_decode_policy_and_equals_offline_at_full_budget(tiny_lm) -> None:
    model, tok = tiny_lm
    methods = ["full", "streamingllm", "h2o"]
    offline = fidelity(model, tok, _samples(), methods, [1.0, 0.3], progress=False)
    online = fidelity(model, tok, _samples(), methods, [1.0, 0.3], online=True, progress=False)
    off = {(r["method"], r["budget"]): r for r in offline.records}
    on = {(r["method"], r["budget"]): r for r in online.records}
    assert online.online and not offline.online
    for method in methods:  # nothing compressed: exactly the full cache, in both modes
        assert on[(method, 1.0)]["rel_error"] == off[(method, 1.0)]["rel_error"] == 0.0
        assert on[(method, 1.0)]["nll_delta"] == off[(method, 1.0)]["nll_delta"] == 0.0
    for method in ("streamingllm", "h2o"):  # the policy evicts while the continuation comes in
        a, b = on[(method, 0.3)], off[(method, 0.3)]
        assert a["online_path"] is True and "online_path" not in b
        assert abs(a["rel_error"] - b["rel_error"]) > 1e-3
        assert a["block_error"] == b["block_error"]  # the compressed prefill cache is the same


def test_online_cache_stays_at_its_budget(tiny_lm) -> None:
    from kvfold.evaluate.running.fidelity import _teacher_forced
    from kvfold.evaluate.running.fidelity_measures import Continuation
    from kvfold.pipeline.context import prefill

    model, tok = tiny_lm
    context = prefill(model, tok, CONTEXT, use_chat_template=False)
    compressed = context.compress("streamingllm", 0.3)
    held = [layer.valid_mask().sum(-1).max().item() for _, layer in compressed.cache.folded_layers]
    ids = tok("Answer: the brown fox jumps", add_special_tokens=False).input_ids
    cont = Continuation("s", "qa", context, ids, [False] * 2 + [True] * (len(ids) - 2))
    for online, grows in ((True, 0), (False, len(ids))):
        cache = compressed.decode_cache() if online else compressed.cache.copy()
        _teacher_forced(model, cache, cont, online=online)
        after = [layer.valid_mask().sum(-1).max().item() for _, layer in cache.folded_layers]
        assert after == [h + grows for h in held]


def test_online_reports_methods_without_online_path(tiny_lm, tmp_path: Path) -> None:
    model, tok = tiny_lm
    result = fidelity(
        model, tok, _samples()[:1], ["snapkv", "streamingllm"], [0.3], online=True, out_dir=tmp_path, progress=False
    )
    snap, stream = result.records
    assert snap["online_path"] is False and "rel_error" not in snap and snap["n"] == 0
    assert stream["online_path"] is True and stream["rel_error"] > 0
    report = (tmp_path / "fidelity.md").read_text()
    assert "No online path" in report and "`snapkv`" in report.split("No online path")[1]
    assert json.loads((tmp_path / "fidelity.json").read_text())["online"] is True


def test_fidelity_resumes_without_redoing_work(tiny_lm, tmp_path: Path, monkeypatch) -> None:
    from kvfold.pipeline.context import PrefilledContext

    model, tok = tiny_lm
    calls = []
    compress = PrefilledContext.compress
    monkeypatch.setattr(PrefilledContext, "compress", lambda self, *a, **k: calls.append(a) or compress(self, *a, **k))
    args = (model, tok, _samples(), ["full", "streamingllm"], [0.5, 0.3])
    first = fidelity(*args, out_dir=tmp_path, progress=False)
    assert len(calls) == 3  # full + 2 budgets, once for the context both questions share
    lines = (tmp_path / "fidelity_samples.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "fidelity_samples.jsonl").write_text("".join(lines[:4]) + lines[4][:20])  # killed mid-write
    calls.clear()
    again = fidelity(*args, out_dir=tmp_path, progress=False)
    assert len(calls) == 2  # only the two lost runs
    assert again.records == first.records
    calls.clear()
    fidelity(*args, out_dir=tmp_path, progress=False)
    assert calls == []
    with pytest.raises(ValueError, match="another configuration"):
        fidelity(*args, online=True, out_dir=tmp_path, progress=False)
