"""GRKV (papers/grkv.md §3, Algorithm 1, App. D): the identities of the paper as property tests,
and the folder on every tiny family, on left-padded batches and with per-head budgets."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods import SpecError, build_method
from kvfold.methods.compaction.grkv import (
    GRKV,
    KeyLinearization,
    family_lambda,
    grkv_merge,
    key_step,
    stratified_positions,
    value_step,
    window_objective,
    window_probs,
)
from tests.conftest import make_tiny_model
from tests.runtime.test_attention import _CharTokenizer

F64 = torch.float64
CONTEXT = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing. " * 3


def _problem(seed: int = 0, batch: int = 2, heads: int = 3, rows: int = 12, c: int = 20, dim: int = 8):
    """A random GRKV problem: queries, retained K⁰/V⁰, a causal-ish bias, free tokens and a target
    produced by a larger 'full' cache (so the retained cache cannot reproduce it exactly)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g, dtype=F64)
    k_full = torch.randn(batch, heads, 3 * c, dim, generator=g, dtype=F64)
    v_full = torch.randn(batch, heads, 3 * c, dim, generator=g, dtype=F64)
    scaling = dim**-0.5
    target = window_probs(q, k_full, torch.zeros(batch, heads, rows, 3 * c, dtype=F64), scaling) @ v_full
    keep = torch.randperm(3 * c, generator=g)[:c].sort().values
    k0, v0 = k_full[:, :, keep].clone(), v_full[:, :, keep].clone()
    bias = torch.zeros(batch, heads, rows, c, dtype=F64)
    bias[..., rows // 2 :, -1] = float("-inf")  # a masked pair (causal mask inside the window)
    bias[..., : rows // 2, -1] = float("-inf")
    free = torch.rand(batch, heads, c, generator=g) > 0.25
    free[..., 0] = False  # a sink
    return q, k0, v0, bias, free, target, scaling


# ---------------------------------------------------------------------------- value step


def test_dual_value_step_equals_primal_closed_form():
    """eq. 8/33 (m×m dual, Woodbury) == eq. 7 (c×c primal) in float64, with and without fixed tokens."""
    q, k0, v0, bias, free, target, scaling = _problem()
    x = window_probs(q, k0, bias, scaling)
    lam = 1e-2
    eye = torch.eye(x.shape[-1], dtype=F64)
    all_free = torch.ones_like(free)
    primal = torch.linalg.solve(x.mT @ x + lam * eye, x.mT @ target + lam * v0)  # eq. 7
    torch.testing.assert_close(value_step(x, target, v0, all_free, lam), primal, rtol=1e-9, atol=1e-9)
    # App. D.3: the same closed form restricted to the free columns, Y_G = Y − X_F V⁰_F.
    xg = x * free[..., None, :]
    xf = x - xg
    primal_free = torch.linalg.solve(xg.mT @ xg + lam * eye, xg.mT @ (target - xf @ v0) + lam * v0)
    dual = value_step(x, target, v0, free, lam)
    torch.testing.assert_close(dual, primal_free, rtol=1e-9, atol=1e-9)
    assert torch.equal(dual[~free], v0[~free])


def test_lambda_to_infinity_returns_the_evicted_cache():
    q, k0, v0, bias, free, target, scaling = _problem(seed=1)
    out = grkv_merge(q, k0, v0, bias, free, target, scaling, lam_k=1e12, lam_v=1e12, solver="exact")
    torch.testing.assert_close(out.keys, k0, rtol=0, atol=1e-9)
    torch.testing.assert_close(out.values, v0, rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_window_objective_after_one_step_is_at_most_the_base(seed):
    q, k0, v0, bias, free, target, scaling = _problem(seed=seed, rows=16, c=24)
    base = window_objective(q, k0, v0, bias, target, scaling)
    # The value step alone is an exact ridge minimizer: never worse than V⁰, even without safeguard.
    v_only = grkv_merge(q, k0, v0, bias, free, target, scaling, update_keys=False, safeguard=False)
    assert bool((v_only.objective <= base + 1e-12).all())
    for solver in ("exact", "cg"):
        out = grkv_merge(q, k0, v0, bias, free, target, scaling, solver=solver)
        torch.testing.assert_close(out.objective_base, base)
        torch.testing.assert_close(window_objective(q, out.keys, out.values, bias, target, scaling), out.objective)
        assert bool((out.objective <= base).all())
        assert bool((out.objective < 0.9 * base).any())  # it does reduce the error
        assert torch.equal(out.keys[~free], k0[~free]) and torch.equal(out.values[~free], v0[~free])


def test_more_steps_never_raise_the_objective():
    q, k0, v0, bias, free, target, scaling = _problem(seed=5)
    one = grkv_merge(q, k0, v0, bias, free, target, scaling, steps=1, solver="exact")
    three = grkv_merge(q, k0, v0, bias, free, target, scaling, steps=3, solver="exact")
    assert bool((three.objective <= one.objective + 1e-12).all())
    assert bool((one.objective < 0.9 * one.objective_base).any())  # the first step moved


# ---------------------------------------------------------------------------- key step


def test_key_linearization_matches_finite_differences():
    q, k0, v0, bias, free, _, scaling = _problem(seed=2)
    lin = KeyLinearization(q, k0, v0, bias, free, scaling)
    direction = torch.randn(k0.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    step = direction * free[..., None]
    eps = 1e-6

    def f(keys):
        return window_probs(q, keys, bias, scaling) @ v0

    finite = (f(k0 + eps * step) - f(k0 - eps * step)) / (2 * eps)
    torch.testing.assert_close(lin.jvp(direction), finite, rtol=1e-6, atol=1e-8)
    # Jᵀ is the adjoint of J, and the explicit Jacobian agrees with the matrix-free products.
    u = torch.randn(lin.output.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    torch.testing.assert_close((lin.jvp(direction) * u).sum(), (direction * lin.vjp(u)).sum())
    jac = lin.matrix()
    torch.testing.assert_close((jac @ direction.flatten(-2)[..., None])[..., 0], lin.jvp(direction).flatten(-2))
    assert bool((lin.vjp(u)[~free] == 0).all())


def test_key_step_cg_matches_the_exact_dual_solve():
    """eq. 10/41 matrix-free (CG through JVP/VJP) == the explicit dual solve; linearized at K_t ≠ K⁰."""
    q, k0, v0, bias, free, target, scaling = _problem(seed=6, rows=6, c=10, dim=6)
    k_t = k0 + 0.1 * torch.randn(k0.shape, generator=torch.Generator().manual_seed(7), dtype=F64) * free[..., None]
    exact, _ = key_step(q, k_t, k0, v0, bias, free, target, scaling, 1e-2, solver="exact")
    cg, residual = key_step(q, k_t, k0, v0, bias, free, target, scaling, 1e-2, solver="cg", cg_iters=150, cg_tol=1e-13)
    assert float(residual.max()) < 1e-10
    torch.testing.assert_close(cg, exact, rtol=1e-7, atol=1e-9)
    # the dual solution solves the primal normal equations (eq. 37): (JᵀJ + λI) z = Jᵀ(e + J g)
    lin = KeyLinearization(q, k_t, v0, bias, free, scaling)
    z = (exact - k0).flatten(-2)[..., None]
    jac = lin.matrix()
    rhs = (target - lin.output + lin.jvp(k_t - k0)).flatten(-2)[..., None]
    torch.testing.assert_close(jac.mT @ (jac @ z) + 1e-2 * z, jac.mT @ rhs, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------- the folder


def _prefill(family: str = "llama", contexts=None, dtype=None):
    model = make_tiny_model(family)
    if dtype is not None:
        model = model.to(dtype)
    model = kvfold.enable(model)
    tok = _CharTokenizer()
    return kvfold.prefill(model, tok, contexts or CONTEXT, use_chat_template=False), tok


def test_specs_options_and_presets():
    composed = build_method("grkv[lam=0.1,steps=2]")
    assert composed.selector.name == "snapkv" and composed.folder.name == "grkv"
    assert composed.folder.lam == 0.1 and composed.folder.steps == 2
    for spec in ("pyramidkv+grkv", "adakv:snapkv+grkv", "criticalkv:snapkv+grkv", "h2o+grkv", "streamingllm+grkv"):
        assert build_method(spec).folder.name == "grkv"
    assert family_lambda("llama") == 1e-2 and family_lambda("mistral") == 1e-1 and family_lambda("qwen3") == 1e-1
    assert GRKV().lambdas("qwen2") == (1e-1, 1e-1)
    assert GRKV(lam=0.5, lam_v=2.0).lambdas("llama") == (0.5, 2.0)
    for bad in ("grkv[fixed=2]", "grkv[keys=false,values=false]", "grkv[solver=lu]", "grkv[lam=0]", "grkv[m=0]"):
        with pytest.raises(SpecError):
            build_method(bad)


def test_fixed_tokens_are_bit_identical_and_lambda_infinity_is_the_eviction():
    prefilled, _ = _prefill()
    spec = "streamingllm[online=false]"  # keeps the 4 sinks (slots 0-3) and the most recent tokens
    base = prefilled.compress(spec, 0.5)
    merged = prefilled.compress(f"{spec}+grkv", 0.5)
    huge = prefilled.compress(f"{spec}+grkv[lam=1e9]", 0.5)
    frozen = prefilled.compress(f"{spec}+grkv[fixed=1]", 0.5)
    n = prefilled.input_ids.shape[1]
    for layer_idx, layer in base.cache.folded_layers:
        k0, v0, beta0, lengths = layer.padded()
        k, v, beta, lengths_m = merged.cache.layers[layer_idx].padded()
        assert torch.equal(lengths, lengths_m) and torch.equal(beta, beta0)
        c = k0.shape[2]
        assert 36 < c < n
        fixed = torch.zeros(c, dtype=torch.bool)
        fixed[:4] = True  # sinks
        fixed[c - 32 :] = True  # the surrogate window's own tokens (the last 32 positions)
        assert torch.equal(k[:, :, fixed], k0[:, :, fixed]) and torch.equal(v[:, :, fixed], v0[:, :, fixed])
        unchanged = ((k == k0).all(-1) & (v == v0).all(-1)).sum(-1)  # (B, H)
        updated = torch.tensor([[h != "base" for h in row] for row in merged.report["grkv"][layer_idx]["choice"]])
        top = int(0.1 * c)  # plus the top 10% of the retained tokens by window attention
        assert bool((unchanged[updated] == 36 + top).all())
        kh, vh, _, _ = huge.cache.layers[layer_idx].padded()
        torch.testing.assert_close(kh, k0, rtol=0, atol=1e-6)
        torch.testing.assert_close(vh, v0, rtol=0, atol=1e-6)
        kf, vf, _, _ = frozen.cache.layers[layer_idx].padded()
        assert torch.equal(kf, k0) and torch.equal(vf, v0)
    report = merged.report["grkv"]
    assert all(r["objective"] <= r["objective_base"] for r in report.values())
    assert sum(r["heads"] - r["base"] for r in report.values()) > 0


def _window_error(full, small, layer_idx: int, positions: torch.Tensor) -> float:
    """‖Y − A_win V‖² of the last prefill queries (eq. 4) on a compressed layer, causal by position."""
    layer = full.cache.layers[layer_idx]
    queries = layer.captured_queries.double()  # (B, H_q, W, D)
    keys, values, beta, _ = layer.padded()
    width, groups = queries.shape[2], queries.shape[1] // keys.shape[1]
    n = keys.shape[2]
    scaling = full.model.model.layers[layer_idx].self_attn.scaling

    def output(k, v, b, pos):
        k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
        b = b.double().repeat_interleave(groups, dim=1)[:, :, None, :]
        seen = pos.repeat_interleave(groups, dim=1)[:, :, None, :] <= (n - width + torch.arange(width))[:, None]
        logits = (queries @ k.mT * scaling + b).masked_fill(~seen, -torch.inf)
        return torch.softmax(logits, -1) @ v

    target = output(keys, values, beta, torch.arange(n).expand(*keys.shape[:3]))
    k, v, b, _ = small.cache.layers[layer_idx].padded()
    return float((output(k, v, b, positions) - target).square().sum())


def test_the_merge_lowers_the_window_error_of_its_own_eviction():
    """GRKV fits the kept entries to the window queries' full-cache output (eq. 4): on every layer
    its error is at most the eviction's (the safeguard), and lower in all (the merge moved)."""
    prefilled, _ = _prefill()
    base = prefilled.compress("snapkv", 0.3)
    merged = prefilled.compress("snapkv+grkv", 0.3)
    full_keys = {i: layer.padded()[0] for i, layer in prefilled.cache.folded_layers}
    total_base = total_merged = 0.0
    for layer_idx, layer in base.cache.folded_layers:
        k0 = layer.padded()[0]  # snapkv keeps entries unchanged: their positions by key
        positions = ((k0[:, :, :, None, :] == full_keys[layer_idx][:, :, None, :, :]).all(-1)).double().argmax(-1)
        evicted = _window_error(prefilled, base, layer_idx, positions)
        folded = _window_error(prefilled, merged, layer_idx, positions)
        assert folded <= evicted * (1 + 1e-4) + 1e-9
        total_base, total_merged = total_base + evicted, total_merged + folded
    assert total_merged < 0.9 * total_base


def test_stratified_positions_cover_the_context_and_skip_padding():
    valid = torch.ones(2, 3, 100, dtype=torch.bool)
    valid[1, :, :40] = False  # a left-padded row: 60 tokens
    pos = stratified_positions(valid, 8, seed=3)
    assert bool(((pos[0] >= torch.arange(8) * 12.5) & (pos[0] < (torch.arange(8) + 1) * 12.5)).all())
    assert bool(((pos[1] >= 40 + torch.arange(8) * 7.5) & (pos[1] < 40 + (torch.arange(8) + 1) * 7.5)).all())
    assert torch.equal(stratified_positions(valid[1:], 8, seed=3)[0], pos[1])  # alone = in a batch
    short = stratified_positions(torch.ones(1, 1, 5, dtype=torch.bool), 8, seed=0)
    assert short.min() >= 0 and short.max() <= 4


def test_stratified_queries_fit_the_whole_context_and_lower_its_error():
    """``queries=stratified``: the fitted queries come from strata of the whole context, and the
    merge lowers their error against the eviction (the objective is computed on them)."""
    prefilled, _ = _prefill("qwen2", [CONTEXT, "a shorter context, padded on the left in the batch; " * 2])
    merged = prefilled.compress("snapkv+grkv[queries=stratified]", 0.3)
    report = merged.report["grkv"]
    assert sum(r["heads"] - r["base"] for r in report.values()) > 0
    assert sum(r["objective"] for r in report.values()) < 0.9 * sum(r["objective_base"] for r in report.values())
    last = prefilled.compress("snapkv+grkv", 0.3)
    differs = [
        not torch.equal(merged.cache.layers[i].padded()[1], last.cache.layers[i].padded()[1])
        for i, _ in last.cache.folded_layers
    ]
    assert all(differs)
    with pytest.raises(SpecError, match="queries"):
        build_method("grkv[queries=first]")


def test_runs_on_every_family_with_a_left_padded_batch(tiny_family):
    contexts = [CONTEXT, "a much shorter context, which the batch pads on the left side"]
    prefilled, _ = _prefill(tiny_family, contexts)
    snap = prefilled.compress("snapkv", 0.4)
    merged = prefilled.compress("grkv", 0.4)
    for layer_idx, layer in snap.cache.folded_layers:
        k0, _, beta0, lengths = layer.padded()
        k, v, beta, lengths_m = merged.cache.layers[layer_idx].padded()
        assert torch.equal(lengths, lengths_m) and torch.equal(beta, beta0)
        assert bool(torch.isfinite(k[torch.isfinite(beta)]).all() and torch.isfinite(v[torch.isfinite(beta)]).all())
    assert merged.kv_bytes == snap.kv_bytes
    assert sum(r["heads"] - r["base"] for r in merged.report["grkv"].values()) > 0
    answers = merged.generate("why?", max_new_tokens=3, use_chat_template=False)
    assert [a.new_tokens for a in answers] == [3, 3]


def test_batch_rows_match_single_contexts():
    contexts = [CONTEXT, "a shorter context, padded on the left in the batch; " * 2]
    batch, _ = _prefill("llama", contexts)
    together = batch.compress("grkv", 0.4)
    for row, text in enumerate(contexts):
        alone = _prefill("llama", text)[0].compress("grkv", 0.4)
        for layer_idx, layer in alone.cache.folded_layers:
            k1, v1, _, lengths1 = layer.padded()
            kb, vb, _, lengths_b = together.cache.layers[layer_idx].padded()
            assert torch.equal(lengths_b[row], lengths1[0])
            n = int(lengths1[0, 0])
            torch.testing.assert_close(kb[row, :, :n], k1[0, :, :n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(vb[row, :, :n], v1[0, :, :n], rtol=1e-4, atol=1e-4)


def test_per_head_budgets_and_other_pairings():
    prefilled, _ = _prefill("qwen2")
    ada = prefilled.compress("adakv:snapkv", 0.3)
    merged = prefilled.compress("adakv:snapkv+grkv", 0.3)
    paged = 0
    for layer_idx, layer in ada.cache.folded_layers:
        _, _, beta0, lengths = layer.padded()
        other = merged.cache.layers[layer_idx]
        paged += other.stored is not None
        assert torch.equal(other.row_lengths(), lengths) and torch.equal(other.padded()[2], beta0)
    assert paged > 0  # rows of different lengths are stored paged, GRKV keeps them so
    assert merged.kv_bytes == ada.kv_bytes
    assert sum(r["heads"] - r["base"] for r in merged.report["grkv"].values()) > 0  # some heads merged
    assert merged.generate("ok?", max_new_tokens=2, use_chat_template=False)[0].new_tokens == 2
    for spec in ("pyramidkv+grkv", "criticalkv:snapkv+grkv", "h2o+grkv", "streamingllm+grkv[steps=2,solver=cg]"):
        compressed = prefilled.compress(spec, 0.3)
        assert compressed.policy is None  # one-shot merge, even after an online selector (h2o)
        assert compressed.generate("ok?", max_new_tokens=2, use_chat_template=False)[0].new_tokens == 2


def test_half_precision_model_stays_finite():
    prefilled, _ = _prefill("llama", dtype=torch.bfloat16)
    merged = prefilled.compress("grkv[keys=true,values=true]", 0.5)
    for _, layer in merged.cache.folded_layers:
        k, v, beta, _ = layer.padded()
        assert k.dtype == torch.bfloat16 and bool(torch.isfinite(k).all() and torch.isfinite(v).all())
    assert all(r["objective"] <= r["objective_base"] for r in merged.report["grkv"].values())
    assert sum(r["heads"] - r["base"] for r in merged.report["grkv"].values()) > 0  # some heads merged
