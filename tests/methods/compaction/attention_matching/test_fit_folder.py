"""``am_fit`` and the fit it shares with Attention Matching: a fit that cannot erase a kept key, the
streamed normal equations, and reference queries chosen for the selector.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.methods import build_method
from kvfold.methods.compaction.attention_matching.fit_folder import AMFit
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from kvfold.runtime.quant_config import QuantConfig
from tests.conftest import CharTokenizer, make_tiny_model

F64 = torch.float64
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps "


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def model64(family: str = "llama"):
    return kvfold.enable(make_tiny_model(family).to(F64))


# ---------------------------------------------------------------------------- a fit that cannot erase a kept key


def rare_key_span(seed: int = 1, T: int = 600, n: int = 800, D: int = 16, keep: int = 30):
    """A span where ``n − 2`` short queries spread their attention over every key (max-shifted mass
    in the hundreds) and 2 queries read one rare key (mass ≈ 1): a needle and its question.
    The kept entries are the rare key and 29 others."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(T, D, generator=g, dtype=F64)
    keys[:, 1] = 0.0
    rare = T // 2
    keys[rare] = 0.0
    keys[rare, 1] = 4.0  # only direction 1 reads it
    values = torch.randn(T, D, generator=g, dtype=F64)
    queries = torch.randn(n, D, generator=g, dtype=F64) * 0.2
    queries[-2:] = 0.0
    queries[-2:, 1] = 2.0  # the queries that read the rare key
    others = [int(i) for i in torch.randperm(T, generator=g) if int(i) != rare][: keep - 1]
    given = torch.tensor(sorted([*others, rare]))
    return keys, values, queries, given, rare


def rare_share(config: FitConfig) -> tuple[float, float]:
    """The rare key's attention share for the queries that read it: before and after the fit."""
    keys, values, queries, given, rare = rare_key_span()
    beta0 = torch.zeros(keys.shape[0], dtype=F64)
    reading = queries[-2:]
    before = torch.softmax(reading @ keys.mT + beta0, -1)[:, rare].mean()
    valid = torch.ones(1, queries.shape[0], dtype=torch.bool)
    res = fit_problems(
        keys[None], values[None], beta0[None], queries[None], valid, None, 1.0, config, given=given[None]
    )
    idx, beta = res.index[0], res.log_mass[0]
    slot = int((idx == rare).nonzero()[0])
    after = torch.softmax(reading @ keys[idx].mT + beta, -1)[:, slot].mean()
    return float(before), float(after)


@pytest.mark.parametrize(
    "options",
    [
        {},  # the default: β ≥ β⁰ and each query's mass residual relative to its mass
        {"beta_max": math.inf},  # the same without the upper bound
        {"beta_max": math.inf, "mass_weight": "none"},  # the floor alone
        {"beta_min": -math.inf, "beta_max": math.inf},  # the relative weighting alone
    ],
)
def test_the_fit_keeps_a_rarely_attended_key(options):
    before, after = rare_share(AMFit(**options).fit_config())
    assert before > 0.8 and abs(after - before) < 0.15


def test_the_unconstrained_fit_erases_the_rarely_attended_key():
    """The paper's plain NNLS (``am_fit[beta_min=-inf,beta_max=inf,mass_weight=none]``) gives the rare
    key w = 0 (β = −inf): the diffuse queries decide its β, the two queries that read it do not count."""
    before, after = rare_share(AMFit(beta_min=-math.inf, beta_max=math.inf, mass_weight="none").fit_config())
    assert after < 0.01 * before


def test_the_default_bound_lets_a_kept_entry_carry_a_thousand_entries_mass():
    """A row of 1,000 copies of one entry and 24 others, one copy kept among the 24: to give every
    query the attention it had, the kept copy needs β = ln 1,000 ≈ 6.9 (it stands for all of them).
    ``am_fit``'s default bound (β − β⁰ ≤ 8) lets it; the bound before (4) stops it at 4."""
    g = torch.Generator().manual_seed(5)
    copies, others, D = 1000, 24, 8
    keys = torch.cat(
        [torch.randn(1, D, generator=g, dtype=F64).expand(copies, D), torch.randn(others, D, generator=g, dtype=F64)]
    )
    values = torch.cat(
        [torch.randn(1, D, generator=g, dtype=F64).expand(copies, D), torch.randn(others, D, generator=g, dtype=F64)]
    )
    queries = torch.randn(200, D, generator=g, dtype=F64) * 0.5
    beta0 = torch.zeros(copies + others, dtype=F64)
    valid = torch.ones(1, queries.shape[0], dtype=torch.bool)
    given = torch.cat([torch.tensor([0]), torch.arange(copies, copies + others)])[None]

    def kept_copy_beta(config: FitConfig) -> float:
        res = fit_problems(keys[None], values[None], beta0[None], queries[None], valid, None, 1.0, config, given=given)
        return float(res.log_mass[0][res.index[0] == 0])

    assert AMFit().beta_max == 8.0
    assert kept_copy_beta(AMFit().fit_config()) == pytest.approx(math.log(copies), abs=0.05)
    assert kept_copy_beta(AMFit(beta_max=4.0).fit_config()) == pytest.approx(4.0, abs=1e-6)


def test_streamed_normal_equations_equal_the_materialised_fit():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(4, 50, 8, generator=g, dtype=F64)
    values = torch.randn(4, 50, 8, generator=g, dtype=F64)
    beta0 = torch.randn(4, 50, generator=g, dtype=F64) * 0.3
    queries = torch.randn(4, 90, 8, generator=g, dtype=F64)
    valid = torch.rand(4, 90, generator=g) > 0.1
    counts = torch.tensor([5, 9, 12, 50])
    for weight in ("none", "relative"):
        base = dict(beta_min=0.0, beta_max=3.0, mass_weight=weight, ridge=1e-12)
        streamed = fit_problems(keys, values, beta0, queries, valid, counts, 0.4, FitConfig(**base, query_block=7))
        exact = fit_problems(keys, values, beta0, queries, valid, counts, 0.4, FitConfig(**base, solver="exact"))
        assert torch.equal(streamed.index, exact.index)
        torch.testing.assert_close(streamed.log_mass, exact.log_mass, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(streamed.values, exact.values, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(streamed.mass_error, exact.mass_error, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(streamed.output_error, exact.output_error, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- reference queries for the selector


def test_am_fit_fits_on_the_repeat_pass_after_a_query_agnostic_selector():
    for spec, sources in [
        ("kvzip+am_fit", ("repeat",)),
        ("knorm[online=false]+am_fit", ("repeat",)),
        ("streamingllm[online=false]+am_fit", ("repeat",)),
        ("random+am_fit", ("repeat",)),
        ("leverage+am_fit", ("repeat",)),
        ("compactor+am_fit", ("context",)),
        ("snapkv+am_fit", ("context",)),
        ("am_fit", ("context",)),
        ("kvzip+am_fit[queries=context]", ("context",)),
    ]:
        method = build_method(spec)
        assert method.folder.sources == sources, spec
        assert (method.query_window > 0) == ("context" in sources), spec
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    assert pre.compress("kvzip+am_fit", 0.3).report["am_fit"]["queries"] == "repeat"


# ---------------------------------------------------------------------------- template and sinks verbatim

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateTokenizer(CharTokenizer):
    """The character tokenizer with a ChatML template (~50 template tokens before the context)."""

    chat_template = CHATML

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        from jinja2 import Template

        return Template(CHATML).render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize(
    ("spec", "refit"),
    [
        ("am_highest_fast", "am_highest_fast[template=false,sinks=0]"),
        ("am_omp_fast", "am_omp_fast[template=false,sinks=0]"),
        ("kvzip+am_fit[template=true,sinks=4]", "kvzip+am_fit"),  # am_fit refits them by default
    ],
)
def test_template_tokens_are_untouched_by_compaction(spec, refit):
    tok = TemplateTokenizer()
    model = model64("llama")
    pre = kvfold.prefill(model, tok, TEXT * 2, methods=[spec])
    head = len(tok("<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\n").input_ids)
    assert (
        pre.input_ids[0, :head].tolist()
        == tok("<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\n").input_ids
    )
    budget = head + 12
    small = pre.compress(spec, budget)
    kept = slots = 0
    for (_, full), (_, layer) in zip(pre.cache.folded_layers, small.cache.folded_layers, strict=True):
        k_full, v_full, _, _ = full.padded()
        keys, values, beta, lengths = layer.padded()
        kept += int(lengths.sum())
        slots += budget * lengths.numel()
        if spec.startswith("am_"):  # every template entry kept, first, as it was (bitwise)
            assert torch.equal(keys[:, :, :head], k_full[:, :, :head])
            assert torch.equal(values[:, :, :head], v_full[:, :, :head])
            assert torch.equal(beta[:, :, :head], torch.zeros_like(beta[:, :, :head]))
            assert bool((beta[:, :, head:][torch.isfinite(beta[:, :, head:])] != 0).any())  # the rest is fitted
        else:  # am_fit: the template entries the selector kept are not refitted
            for h in range(keys.shape[1]):
                match = (keys[0, h, :, None, :] == k_full[0, h, None, :head, :]).all(-1)  # (kept, template)
                rows, cols = match.nonzero(as_tuple=True)
                assert rows.numel() >= 4  # KVzip's sinks at least
                assert torch.equal(values[0, h, rows], v_full[0, h, cols])
                assert torch.equal(beta[0, h, rows], torch.zeros_like(beta[0, h, rows]))
    assert kept <= slots  # the template counts in the budget (KVzip's budgets are global)
    _, layer = pre.compress(refit, budget).cache.folded_layers[0]
    assert not torch.equal(layer.padded()[2][:, :, :4], torch.zeros_like(layer.padded()[2][:, :, :4]))  # refitted


# ---------------------------------------------------------------------------- keys chosen from a pre-selection


def test_candidates_limit_the_highest_attention_keys_to_the_preselection():
    """``fit_problems(candidates=)`` keeps the ``t`` candidates with the largest mean squared
    attention weight over the reference queries (App. F.1), the weights read over every entry."""
    g = torch.Generator().manual_seed(4)
    T, n, D, t = 40, 60, 8, 5
    keys, values = torch.randn(T, D, generator=g, dtype=F64), torch.randn(T, D, generator=g, dtype=F64)
    queries = torch.randn(n, D, generator=g, dtype=F64)
    candidates = torch.zeros(T, dtype=torch.bool)
    candidates[torch.randperm(T, generator=g)[:15]] = True
    result = fit_problems(
        keys[None],
        values[None],
        torch.zeros(1, T, dtype=F64),
        queries[None],
        torch.ones(1, n, dtype=torch.bool),
        torch.tensor([t]),
        D**-0.5,
        FitConfig(),
        candidates=candidates[None],
    )
    weights = torch.softmax(queries @ keys.T * D**-0.5, dim=-1)  # every entry in the denominator
    score = weights.square().mean(0).masked_fill(~candidates, -math.inf)
    assert result.index[0, : int(result.lengths[0])].tolist() == sorted(score.topk(t).indices.tolist())
    everyone = fit_problems(
        keys[None],
        values[None],
        torch.zeros(1, T, dtype=F64),
        queries[None],
        torch.ones(1, n, dtype=torch.bool),
        torch.tensor([t]),
        D**-0.5,
        FitConfig(),
    )
    assert everyone.index[0].tolist() != result.index[0].tolist()  # the pre-selection mattered here


def test_preselect_keeps_kvzips_allocation_with_keys_chosen_by_attention_among_a_larger_selection():
    """``kvzip+am_fit[preselect=2]``: every head holds what KVzip's global ranking gives it at the
    budget; its keys are KVzip's sinks and keys from KVzip's selection at twice the budget, not
    all of them KVzip's selection at the budget; ``preselect=1`` is the default, bit for bit."""
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT * 4, use_chat_template=False)
    budget = 0.2
    chosen = pre.compress("kvzip+am_fit[preselect=2]", budget).cache
    plain = pre.compress("kvzip", budget).cache
    count = int(kvfold.Budget.parse(budget).counts(torch.tensor([pre.input_ids.shape[1]]))[0])
    wider = pre.compress("kvzip", 2 * count).cache  # the pre-selection: twice the budget's entries
    default, same = pre.compress("kvzip+am_fit", budget).cache, pre.compress("kvzip+am_fit[preselect=1]", budget).cache
    differs = False
    for (_, full), (_, c), (_, p), (_, w) in zip(
        pre.cache.folded_layers, chosen.folded_layers, plain.folded_layers, wider.folded_layers, strict=True
    ):
        keys, _, beta, lengths = c.padded()
        assert torch.equal(lengths, p.padded()[3])  # KVzip's allocation at the budget
        for h in range(keys.shape[1]):
            kept = keys[0, h, : int(lengths[0, h])]
            in_wider = (kept[:, None, :] == w.padded()[0][0, h, None, : int(w.padded()[3][0, h])]).all(-1).any(-1)
            assert bool(in_wider.all())  # chosen among the pre-selection
            assert torch.equal(kept[:4], full.padded()[0][0, h, :4])  # the sinks stay
            in_plain = (kept[:, None, :] == p.padded()[0][0, h, None, : int(p.padded()[3][0, h])]).all(-1).any(-1)
            differs |= not bool(in_plain.all())
        assert torch.isfinite(beta[0][torch.arange(beta.shape[-1])[None, :] < lengths[0][:, None]]).all()
    assert differs  # some key outside KVzip's own selection at the budget
    for (_, a), (_, b) in zip(default.folded_layers, same.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            assert torch.equal(x, y)


def test_preselect_options_are_checked():
    from kvfold.methods.core.spec import SpecError

    with pytest.raises(SpecError, match="preselect must be ≥ 1"):
        build_method("kvzip+am_fit[preselect=0.5]")
    with pytest.raises(SpecError, match="follows a plain selector"):
        build_method("adakv:snapkv+am_fit[preselect=2]")
    model = model64("llama")
    pre = kvfold.prefill(model, CharTokenizer(), TEXT * 2, use_chat_template=False)
    with pytest.raises(SpecError, match="fits in one piece"):
        pre.compress("kvzip+am_fit[preselect=2,fit_chunk=64]", 0.3)


# ---------------------------------------------------------------------------- the top-scored entries verbatim


def test_top_verbatim_keeps_the_selectors_highest_scored_entries_as_they_are_and_fits_the_rest():
    """``kvzip+am_fit[top_verbatim=0.25]``: the same keys as ``kvzip``; in each head the quarter
    of the kept entries KVzip scored highest keep their values and β⁰ bit for bit, the others are
    refitted; 0 is the default bit for bit, 1 is ``kvzip`` itself (nothing refitted)."""
    from kvfold.methods import CompressionContext

    model, tok = model64("llama"), CharTokenizer()
    pre = kvfold.prefill(model, tok, TEXT * 4, use_chat_template=False)
    work = pre.cache.copy()
    ctx = CompressionContext(model, work, pre.input_ids, pre.attention_mask, kvfold.Budget.parse(0.3), tokenizer=tok)
    with torch.no_grad():
        build_method("kvzip+am_fit[top_verbatim=0.25]").compress(ctx)
    default = pre.compress("kvzip+am_fit", 0.3).cache
    verbatim_seen = refitted_seen = 0
    for (i, full), (_, layer), (_, fit) in zip(
        pre.cache.folded_layers, work.folded_layers, default.folded_layers, strict=True
    ):
        k_full, v_full, _, _ = full.padded()
        keys, values, beta, lengths = layer.padded()
        assert torch.equal(keys, fit.padded()[0])  # KVzip's keys either way
        scores = ctx.memo["kvzip_scores"][i][0]
        for h in range(keys.shape[1]):
            n = int(lengths[0, h])
            slots = (keys[0, h, :n, None, :] == k_full[0, h, None, :, :]).all(-1).float().argmax(-1)
            top = scores[h, slots].argsort(dim=-1, descending=True, stable=True)[: math.ceil(0.25 * n)]
            exact = (values[0, h, :n] == v_full[0, h, slots]).all(-1) & (beta[0, h, :n] == 0)
            expected = torch.zeros(n, dtype=torch.bool)
            expected[top] = True
            assert torch.equal(exact, expected), (i, h)
            verbatim_seen += int(expected.sum())
            refitted_seen += int((~expected).sum())
            fitted_there = (fit.padded()[1][0, h, :n][top] == v_full[0, h, slots[top]]).all(-1)
            assert not bool(fitted_there.all())  # the default refits them
            # the refitted entries are the fit of the rest of the cache with the verbatim ones in place
            queries = ctx.memo["am_fit_queries"][i]
            span = torch.zeros(1, 1, k_full.shape[2], dtype=F64)
            span[0, 0, slots[expected]] = -math.inf
            given = slots[~expected][None, None]
            reference = fit_problems(
                k_full[:, h : h + 1], v_full[:, h : h + 1], span, queries.queries[:, h : h + 1],
                queries.valid[:, h : h + 1], None, model.model.layers[i].self_attn.scaling, AMFit().fit_config(),
                given=given,
            )  # fmt: skip
            torch.testing.assert_close(values[0, h, :n][~expected], reference.values[0, 0].to(values.dtype))
            torch.testing.assert_close(beta[0, h, :n][~expected], reference.log_mass[0, 0].to(beta.dtype))
    assert verbatim_seen and refitted_seen
    same = pre.compress("kvzip+am_fit[top_verbatim=0]", 0.3).cache
    plain = pre.compress("kvzip", 0.3).cache
    every_entry = pre.compress("kvzip+am_fit[top_verbatim=1]", 0.3)
    kept_all = every_entry.cache
    # nothing left to fit: no layer is solved, each is listed as kept as selected
    assert every_entry.report["am_fit"]["verbatim_layers"] == [i for i, _ in kept_all.folded_layers]
    assert "mass_error" not in every_entry.report["am_fit"]
    for (_, a), (_, b), (_, c), (_, d) in zip(
        default.folded_layers, same.folded_layers, plain.folded_layers, kept_all.folded_layers, strict=True
    ):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            assert torch.equal(x, y)
        for x, y in zip(c.padded(), d.padded(), strict=True):
            assert torch.equal(x, y)


def test_top_verbatim_options_are_checked():
    from kvfold.methods.core.spec import SpecError

    with pytest.raises(SpecError, match="top_verbatim must be a fraction"):
        build_method("kvzip+am_fit[top_verbatim=1.5]")
    with pytest.raises(SpecError, match="without preselect"):
        build_method("kvzip+am_fit[top_verbatim=0.25,preselect=2]")


# ---------------------------------------------------------------------------- layers of few entries as selected


def test_verbatim_rows_keeps_layers_of_few_entries_as_selected_and_fits_the_others():
    """``kvzip+am_fit[verbatim_rows=n]``: a layer whose rows keep on average at most ``n`` entries
    is ``kvzip``'s bit for bit (values and β⁰ as selected, not fitted), every other layer is the
    default fit's bit for bit; a threshold above every layer is ``kvzip`` itself."""
    model, tok = model64("llama"), CharTokenizer()
    pre = kvfold.prefill(model, tok, TEXT * 4, use_chat_template=False)
    plain = pre.compress("kvzip", 0.3).cache
    fitted = pre.compress("kvzip+am_fit", 0.3).cache
    rows = {i: layer.row_lengths()[0] for i, layer in plain.folded_layers}
    means = {i: float(row.float().mean()) for i, row in rows.items()}

    def splits(n: int) -> bool:  # a layer kept as selected, and a fitted one with a row of ≤ n entries
        fitted = [i for i in rows if means[i] > n]
        return len(fitted) < len(rows) and any(int(rows[i].min()) <= n for i in fitted)

    threshold = next(n for n in range(1, int(max(means.values())) + 1) if splits(n))  # per layer, not per head
    few = {i for i, mean in means.items() if mean <= threshold}
    split = pre.compress(f"kvzip+am_fit[verbatim_rows={threshold}]", 0.3)
    assert split.report["am_fit"]["verbatim_layers"] == sorted(few)
    for (i, layer), (_, a), (_, b) in zip(
        split.cache.folded_layers, plain.folded_layers, fitted.folded_layers, strict=True
    ):
        expected = a if i in few else b
        for x, y in zip(layer.padded(), expected.padded(), strict=True):
            assert torch.equal(x, y), i
    assert any(
        not torch.equal(a.padded()[1], b.padded()[1])
        for (i, a), (_, b) in zip(plain.folded_layers, fitted.folded_layers, strict=True)
        if i in few
    )  # the default fits the layers the option keeps as selected
    every = pre.compress("kvzip+am_fit[verbatim_rows=100000]", 0.3).cache
    for (_, a), (_, b) in zip(every.folded_layers, plain.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            assert torch.equal(x, y)


def test_verbatim_rows_options_are_checked():
    from kvfold.methods.core.spec import SpecError

    with pytest.raises(SpecError, match="verbatim_rows and shared_queries ≥ 0"):
        build_method("kvzip+am_fit[verbatim_rows=-1]")
    with pytest.raises(SpecError, match="without preselect"):
        build_method("kvzip+am_fit[verbatim_rows=32,preselect=2]")


# ---------------------------------------------------------------------------- quantized storage: the fit order


@pytest.mark.parametrize("order", ["before", "after"])
def test_am_fit_fits_to_the_keys_as_stored_then_stores_the_fitted_values(monkeypatch, order):
    """``quant_order=before`` (default): β and the values are fitted to the kept keys exactly as the
    quantized cache then holds them; ``after``: to the keys as they were."""
    from kvfold.methods.compaction.attention_matching import fit_folder

    seen = []
    real = fit_folder.fit_problems

    def spy(*args, **kwargs):
        seen.append((args[0], kwargs.get("given"), kwargs.get("compact_keys")))
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_folder, "fit_problems", spy)
    model = kvfold.enable(make_tiny_model("llama"))
    context = kvfold.prefill(model, CharTokenizer(), TEXT * 4, use_chat_template=False, methods="kvzip+am_fit")
    spec = "kvzip+am_fit@int4" if order == "before" else "kvzip+am_fit[quant_order=after]@int4"
    small = context.compress(spec, 0.25)
    assert len(seen) == len(small.cache.folded_layers)
    for (_, layer), (keys, given, compact) in zip(small.cache.folded_layers, seen, strict=True):
        assert layer.is_quantized
        stored, _, log_mass = layer.stored_padded()
        valid = torch.isfinite(log_mass)
        if order == "after":
            assert compact is None
            continue
        d = keys.shape[-1]
        fitted = compact.gather(2, given.clamp_min(0)[..., None].expand(-1, -1, -1, d))
        used = given >= 0
        assert torch.equal(fitted[used], stored[:, :, : given.shape[-1]][used & valid[:, :, : given.shape[-1]]])
        assert not torch.equal(fitted[used], keys.gather(2, given.clamp_min(0)[..., None].expand(-1, -1, -1, d))[used])


def test_the_fit_rounds_its_values_to_the_storage_grid_on_both_solvers():
    """``FitConfig.value_storage``: the fitted values come back on their grid in that storage (GPTQ's
    error feedback, :mod:`~kvfold.methods.compaction.attention_matching.value_rounding`), the same on
    the streamed and the exact solver, and the reported output error counts the rounding."""
    from kvfold.methods.compaction.attention_matching.value_rounding import round_entries

    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(3, 40, 8, generator=g, dtype=F64), torch.randn(3, 40, 8, generator=g, dtype=F64)
    beta0 = torch.zeros(3, 40, dtype=F64)
    queries = torch.randn(3, 60, 8, generator=g, dtype=F64)
    valid = torch.ones(3, 60, dtype=torch.bool)
    counts = torch.tensor([6, 10, 14])
    storage = QuantConfig(format="int3")
    base = dict(beta_min=0.0, beta_max=3.0, ridge=1e-12)
    plain = fit_problems(keys, values, beta0, queries, valid, counts, 0.4, FitConfig(**base))
    fits = [
        fit_problems(keys, values, beta0, queries, valid, counts, 0.4, FitConfig(**base, value_storage=storage, **more))
        for more in ({}, {"solver": "exact"})
    ]
    for fit in fits:
        used = torch.arange(fit.values.shape[1])[None, :] < fit.lengths[:, None]
        step = (fit.values.amax(-1) - fit.values.amin(-1))[..., None] / 7  # a code step of each entry
        # on the grid: rounding again moves a value by well under a step (the scale re-derived may
        # be a float16 ulp or two wider)
        assert bool(((round_entries(fit.values, storage) - fit.values).abs() <= 2e-2 * step)[used].all())
        assert not bool(((round_entries(plain.values, storage) - plain.values).abs() <= 2e-2 * step)[used].all())
        assert bool((fit.output_error > plain.output_error).all())  # the rounding is counted
    torch.testing.assert_close(fits[0].values, fits[1].values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fits[0].output_error, fits[1].output_error, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "option,storage,rounds",
    [
        ("[value_feedback=true]", "int3[clip=1]", True),
        ("[value_feedback=true]", "int4[rotate=1]", True),
        ("", "int3", False),  # off by default
        ("[value_feedback=true]", "fp8", False),  # no integer grid to round to
    ],
)
def test_value_feedback_gives_the_fit_the_caches_format(monkeypatch, option, storage, rounds):
    from kvfold.methods.compaction.attention_matching import fit_folder

    seen = []
    real = fit_folder.fit_problems

    def spy(*args, **kwargs):
        seen.append(args[7].value_storage)
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_folder, "fit_problems", spy)
    model = kvfold.enable(make_tiny_model("llama"))
    context = kvfold.prefill(model, CharTokenizer(), TEXT * 4, use_chat_template=False, methods="kvzip+am_fit")
    context.compress(f"kvzip+am_fit{option}@{storage}", 0.25)
    context.compress(f"kvzip+am_fit{option}", 0.25)  # unquantized: nothing to round to
    layers = len(seen) // 2
    expected = QuantConfig.parse(storage) if rounds else None
    assert seen[:layers] == [expected] * layers and seen[layers:] == [None] * layers


@pytest.mark.parametrize("key_group,short", [(32, False), (128, True)])
def test_a_wide_layer_is_fitted_to_its_keys_as_it_stores_them(monkeypatch, key_group, short):
    """``@int3[wide=16]``: a layer whose rows hold at most one key group stays in the model's dtype, so
    its fit reads its kept keys as they are; the other layers' fits read them in 3 bits."""
    from kvfold.methods.compaction.attention_matching import fit_folder

    seen = []
    real = fit_folder.fit_problems

    def spy(*args, **kwargs):
        seen.append(kwargs.get("compact_keys"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_folder, "fit_problems", spy)
    model = kvfold.enable(make_tiny_model("llama"))
    context = kvfold.prefill(model, CharTokenizer(), TEXT * 4, use_chat_template=False, methods="kvzip+am_fit")
    small = context.compress(f"kvzip+am_fit@int3[wide=16,key_group={key_group}]", 0.25)
    assert all((compact is None) == short for compact in seen)
    assert all(layer.is_quantized != short for _, layer in small.cache.folded_layers)
