"""Fidelity on a tiny random model: full is exact, eviction errors grow as the budget shrinks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvfold.evaluate import Sample, fidelity
from kvfold.evaluate.fidelity import _block_outputs, reference_answer

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
    out = _block_outputs(queries, full, 0.3)
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
    torch.testing.assert_close(_block_outputs(queries, with_dup, 0.3), _block_outputs(queries, folded, 0.3))
    empty = torch.full((h_kv, 1), -math.inf, dtype=torch.float64)  # an empty slot changes nothing
    padded = (dup_k[:, :6].double(), dup_v[:, :6].double(), torch.cat([folded_beta, empty], 1))
    torch.testing.assert_close(_block_outputs(queries, padded, 0.3), _block_outputs(queries, folded, 0.3))
