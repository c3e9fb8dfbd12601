"""KVzip's successors as options of its scores: KVzip+ normalization (``kvzip[plus=true]``,
Jégou & Jeblick 2026) and structure demotion (``kvzip[demote=0.25]``, NVIDIA/kvpress#288).

KVzip+ is checked against a float64 reference written here with explicit loops over layers, heads,
repeat queries and entries, from the stock (eager) model's attention probabilities, the hidden
states entering each attention and the values projected by ``o_proj``; structure demotion against
the tokens named by an independent reading of the text.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvfold
from kvfold.methods import CompressionContext, SpecError, build_method
from kvfold.methods.core import repeat
from kvfold.methods.eviction.kvzip import RepeatPrompt, is_structure_text, structure_tokens
from kvfold.pipeline.chat import ChatSession
from kvfold.runtime import key_scores, triton_attention
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from tests.conftest import TINY, CharTokenizer, make_tiny_model

F64 = torch.float64
TEXT = "Red, green; blue, pink; 3.14, 8-4; gold, jade; 2.71, 6-1; mint, rose, teal; 1.41, 5-9; Sky, 0-2, Ash. "
"""Separators (``,`` ``;`` and spaces) repeated many times, ``.`` and ``-`` mostly glued inside numbers."""


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class TextTokenizer(CharTokenizer):
    """The test tokenizer (one id per character), with a ``decode`` that gives the characters back
    (for texts without newlines, ``z`` and ``{|}~``, whose ids collide with others')."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 88) if 9 <= i <= 33 else chr(i - 2) if i >= 34 else "" for i in ids)


def tiny(family: str = "llama", dtype: torch.dtype = F64) -> torch.nn.Module:
    """A tiny model whose input layernorms have random weights, so that ``‖x_t‖`` differs per token
    (with unit weights an RMS-normalised input has norm √hidden for every token)."""
    model = make_tiny_model(family).to(dtype)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = torch.rand(layer.input_layernorm.weight.shape, generator=generator, dtype=F64) * 1.5 + 0.25
            layer.input_layernorm.weight.copy_(weight.to(dtype))
    return model


def compress(model, tok, spec: str, budget: float = 0.3, text: str = TEXT) -> tuple[CompressionContext, FoldedCache]:
    """Prefill ``text`` and compress it with ``spec``: the context (its memo holds the scores) and
    an uncompressed copy of the cache."""
    pre = kvfold.prefill(model, tok, text, use_chat_template=False)
    full = pre.cache.copy()
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(budget), tokenizer=tok)
    with torch.no_grad():
        build_method(spec).compress(ctx)
    return ctx, full


def held_keys(cache: FoldedCache) -> list[torch.Tensor]:
    return [layer.padded()[0] for _, layer in cache.folded_layers]


# ---------------------------------------------------------------------------- KVzip+


def plus_reference(model_family: str, ids: list[int], inputs: list[list[int]]) -> dict[int, torch.Tensor]:
    """``max_h max_t a_{h,t,i} / ‖x_t‖ · ‖W_Oʰ v_i‖`` in float64 with explicit loops, for each repeat
    chunk over ``context + repeat input`` (one causal forward, as the repeat pass over a copy of the
    prefilled cache): ``x_t`` the stock model's hidden state after layer ``l``'s input layernorm,
    ``a`` the float64 softmax of its rotated queries and keys, ``v_i`` its values, ``W_Oʰ`` query
    head ``h``'s columns of ``o_proj`` (KV head of query head ``h``: ``h // G``)."""
    stock = tiny(model_family)
    n, heads_q, heads_kv, dim = len(ids), TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]
    groups = heads_q // heads_kv
    scores = {layer: torch.zeros(heads_kv, n, dtype=F64) for layer in range(TINY["num_hidden_layers"])}
    for repeat_ids in inputs:
        length = n + len(repeat_ids)
        positions = torch.arange(length)[None]
        with torch.no_grad():
            hidden = stock(input_ids=torch.tensor([ids + repeat_ids]), output_hidden_states=True).hidden_states
            for layer_idx, block in enumerate(stock.model.layers):
                attn = block.self_attn
                x = block.input_layernorm(hidden[layer_idx])  # (1, T, hidden): what the attention module reads
                cos, sin = stock.model.rotary_emb(x, positions)
                q = attn.q_proj(x).view(1, length, heads_q, dim).transpose(1, 2)
                k = attn.k_proj(x).view(1, length, heads_kv, dim).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                values = attn.v_proj(x[0, :n]).view(n, heads_kv, dim)
                for h in range(heads_q):
                    kv = h // groups
                    w_h = attn.o_proj.weight[:, h * dim : (h + 1) * dim]
                    out_norms = [float((w_h @ values[i, kv]).norm()) for i in range(n)]
                    for t in range(n, length):
                        probs = torch.softmax(q[0, h, t] @ k[0, kv, : t + 1].T * attn.scaling, dim=-1)
                        x_norm = float(x[0, t].norm())
                        for i in range(n):
                            value = float(probs[i]) / x_norm * out_norms[i]
                            scores[layer_idx][kv, i] = max(float(scores[layer_idx][kv, i]), value)
    return scores


@pytest.mark.parametrize(("family", "chunk"), [("llama", 2048), ("qwen2", 40)])
def test_kvzip_plus_scores_equal_the_float64_reference(family, chunk):
    """``kvzip[plus=true]``: each attention row divided by the norm of the hidden state entering the
    layer's attention, each column multiplied by ‖W_Oʰ v‖, max over queries, chunks and the group
    (KVzip+, Jégou & Jeblick 2026)."""
    tok = TextTokenizer()
    text = TEXT[:60]
    ctx, _ = compress(kvfold.enable(tiny(family)), tok, f"kvzip[plus=true,chunk={chunk}]", text=text)
    ids = ctx.input_ids[0].tolist()
    inputs = RepeatPrompt.build(tok).chunk_inputs(ids, chunk)
    assert len(inputs) == (1 if chunk == 2048 else 2)
    reference = plus_reference(family, ids, inputs)
    for layer_idx, expected in reference.items():
        torch.testing.assert_close(ctx.memo["kvzip_scores"][layer_idx][0], expected, rtol=1e-10, atol=1e-13)


def test_the_fused_kvzip_plus_scores_equal_the_eager_ones_and_the_reference(monkeypatch):
    """A float32 model takes the fused path (the log-sum-exp, the row norm inside the exponent);
    its KVzip+ scores equal the eager path's, and the float64 reference to float32 rounding, for
    two rows of different lengths (left padding)."""
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama", torch.float32))
    pre = kvfold.prefill(model, tok, [TEXT, TEXT[:50]], use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    calls = []
    real = repeat.max_received
    monkeypatch.setattr(repeat, "max_received", lambda *args: calls.append(len(args)) or real(*args))
    fused = repeat.repeat_pass(ctx, chunk=48, forward_chunk=32, queries=False, plus=True)
    assert 6 in calls  # the KVzip+ scores took the fused path
    monkeypatch.setattr(repeat.RepeatRecorder, "accepts_log_sum_exp", False)
    eager = repeat.repeat_pass(ctx, chunk=48, forward_chunk=32, queries=False, plus=True)
    width = pre.input_ids.shape[1]
    short = int(pre.attention_mask[1].sum())
    row = pre.input_ids[1, width - short :].tolist()
    reference = plus_reference("llama", row, RepeatPrompt.build(tok).chunk_inputs(row, 48))
    for i in fused.plus_scores:
        torch.testing.assert_close(fused.plus_scores[i], eager.plus_scores[i], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(
            fused.plus_scores[i][1, :, width - short :].to(F64), reference[i], rtol=1e-4, atol=1e-7
        )
        assert bool(torch.isneginf(fused.plus_scores[i][1, :, : width - short]).all())
        assert not torch.equal(fused.plus_scores[i], fused.scores[i])


def test_kvzip_plus_changes_the_kept_entries_and_shares_the_repeat_pass():
    """``kvzip[plus=true]`` keeps other entries than ``kvzip``; ``kvzip[plus=true]+am_fit`` pays for one
    pass (the fit's queries come from it), and KVzip+ after a plain pass costs one scores-only pass."""
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama"))
    plain, _ = compress(model, tok, "kvzip")
    plus, _ = compress(model, tok, "kvzip[plus=true]")
    assert any(not torch.equal(a, b) for a, b in zip(held_keys(plain.cache), held_keys(plus.cache), strict=True))

    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.3), tokenizer=tok)
    calls.clear()
    repeat.repeat_pass(ctx)
    one_pass = len(calls)
    calls.clear()
    pre.compress("kvzip[plus=true]", 0.3)  # the context's pass: KVzip+'s and KVzip's scores, the queries
    pre.compress("kvzip[plus=true]+am_fit", 0.3)
    pre.compress("kvzip", 0.2)
    pre.compress("kvzip+am_fit", 0.2)
    assert len(calls) == one_pass
    again = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    calls.clear()
    again.compress("kvzip", 0.3)
    again.compress("kvzip[plus=true]", 0.3)  # recorded without KVzip+: one pass of its scores alone
    again.compress("kvzip[plus=true]", 0.2)
    assert len(calls) == 2 * one_pass


# ---------------------------------------------------------------------------- structure demotion


def named_structure(text: str, repeats: int) -> list[int]:
    """Character positions of ``text`` that structure demotion names, read off the text: a
    whitespace or punctuation character seen at least ``repeats`` times, unless it is a
    non-space between two alphanumeric characters."""
    out = []
    for j, c in enumerate(text):
        if c.isalnum() or text.count(c) < repeats:
            continue
        if not c.isspace() and 0 < j < len(text) - 1 and text[j - 1].isalnum() and text[j + 1].isalnum():
            continue
        out.append(j)
    return out


def test_structure_tokens_are_repeated_punctuation_and_whitespace_but_not_joiners():
    assert all(is_structure_text(t) for t in (",", " ", "\n\n", ".\n", " (", "$", "—", "||"))
    assert not any(is_structure_text(t) for t in ("", " word", "7", "é", "'s", ".a", "\ufffd"))
    tok = TextTokenizer()
    ids = tok(TEXT).input_ids
    named = structure_tokens(tok, ids, 1, 4)
    assert named == [j + 1 for j in named_structure(TEXT, 4)]  # the BOS before the text is not counted
    chars = {TEXT[j - 1] for j in named}
    assert chars == {",", ";", " ", "."}  # "." only once: at the end, before a space
    assert [TEXT[j - 1] for j in named].count(".") == 1 and "-" not in chars
    assert structure_tokens(tok, ids, 1, 100) == []


@pytest.mark.parametrize("pool", [1, 3])
def test_structure_demotion_lowers_exactly_the_tokens_it_names(pool):
    """``kvzip[demote=0.25]``: the scores of the named tokens are KVzip's times 0.25, every other
    score is KVzip's bit for bit; the kept entries differ (the budget goes to content)."""
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama"))
    plain, _ = compress(model, tok, f"kvzip[pool={pool}]")
    demoted, _ = compress(model, tok, f"kvzip[pool={pool},demote=0.25]")
    named = torch.zeros(len(TEXT) + 1, dtype=torch.bool)
    named[[j + 1 for j in named_structure(TEXT, 4)]] = True
    assert demoted.report["kvzip_demoted"] == [int(named.sum())]
    for layer_idx, before in plain.memo["kvzip_scores"].items():
        after = demoted.memo["kvzip_scores"][layer_idx]
        assert torch.equal(after[..., named], before[..., named] * 0.25)
        assert torch.equal(after[..., ~named], before[..., ~named])
    assert any(not torch.equal(a, b) for a, b in zip(held_keys(plain.cache), held_keys(demoted.cache), strict=True))


def test_the_options_are_checked():
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama"))
    for spec in ("kvzip[demote=1.5]", "kvzip[demote=-0.1]", "kvzip[demote_repeats=0]"):
        with pytest.raises(SpecError, match="demote"):
            build_method(spec)
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.3))
    with pytest.raises(ValueError, match="needs the tokenizer"):
        build_method("kvzip[demote=0.25]").compress(ctx)


# ---------------------------------------------------------------------------- chunk scope


def test_chunk_scope_keeps_other_entries_on_a_context_of_several_chunks_and_the_same_on_one():
    """``kvzip[scope=chunk]`` ranks by the span scores (each entry by its own repeat chunk): other
    entries than ``kvzip`` on a context of several chunks, the same on one chunk; its mutation
    (ranking by the whole-context scores) makes the first assertion fail. A chat refuses it (a
    compacted cache has no chunk of tokens per entry), and an unknown scope is a spec error."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))  # unit layernorms: sharper attention than tiny()'s
    text = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 3
    specs = ("kvzip[chunk=24,scope=all]", "kvzip[chunk=24,scope=chunk]")
    several = [compress(model, tok, spec, 0.3, text)[0] for spec in specs]
    kept = [held_keys(ctx.cache) for ctx in several]
    assert any(not torch.equal(a, b) for a, b in zip(*kept, strict=True))
    one = [compress(model, tok, spec, 0.3, text)[0] for spec in ("kvzip[scope=all]", "kvzip[scope=chunk]")]
    kept = [held_keys(ctx.cache) for ctx in one]
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))
    with pytest.raises(ValueError, match="cannot compact a conversation again"):
        ChatSession(model, tok, "kvzip[scope=chunk]+am_fit", budget=32)
    with pytest.raises(SpecError, match="scope must be one of all, chunk, auto"):
        build_method("kvzip[scope=span]")


def test_auto_scope_scores_by_chunk_on_long_fresh_contexts_only(monkeypatch):
    """``kvzip[scope=auto]`` keeps what ``scope=chunk`` keeps on a fresh prefill of at least
    ``SCOPE_CHUNK_FROM`` tokens (and records the span scores only), what ``scope=all`` keeps on a
    shorter one; a chat, whose compacted cache has no chunk per entry, compacts with it as ``all``."""
    from kvfold.methods.eviction import kvzip as kvzip_module

    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    text = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 3
    recorded = []
    real = repeat.repeat_pass
    monkeypatch.setattr(repeat, "repeat_pass", lambda *a, **k: recorded.append(k["records"]) or real(*a, **k))

    def kept(spec):
        return held_keys(compress(model, tok, spec, 0.3, text)[0].cache)

    assert build_method("kvzip").selector.scope == "auto"  # the default
    monkeypatch.setattr(kvzip_module, "SCOPE_CHUNK_FROM", 10**6)
    assert all(map(torch.equal, kept("kvzip[chunk=24,scope=auto]"), kept("kvzip[chunk=24,scope=all]")))
    monkeypatch.setattr(kvzip_module, "SCOPE_CHUNK_FROM", 64)
    recorded.clear()
    auto = kept("kvzip[chunk=24,scope=auto]")
    assert recorded == [{"span_scores"}]
    assert all(map(torch.equal, auto, kept("kvzip[chunk=24,scope=chunk]")))
    assert not all(map(torch.equal, auto, kept("kvzip[chunk=24,scope=all]")))
    chat = ChatSession(model, tok, "kvzip[scope=auto]+am_fit", budget=32, context=text)
    for _ in range(3):
        chat.ask("where is the fox? " * 2, max_new_tokens=8)
    assert chat.stats()["compactions"] >= 2  # later ones on a compacted cache: scope all


# ---------------------------------------------------------------------------- head-budget schedule


def uneven_schedule(model, path) -> str:
    """A hand-made head-budget schedule for ``model`` (two layers of two KV heads), saved at ``path``."""
    from kvfold.methods.core.head_schedule import HeadSchedule, config_hash

    layers = [i for i, _ in FoldedCache(model.config).folded_layers]
    HeadSchedule("tiny", config_hash(model.config), layers, [[0.5, 0.1], [0.3, 0.1]]).save(path)
    return str(path)


def test_a_schedule_sets_each_heads_count_and_kvzip_fills_it_with_its_best_scores(tmp_path):
    """``kvzip[schedule=…]``: every head keeps its sinks plus its share of the rest of the budget
    (AM §3.4's per-head budgets, in place of KVzip's one ranking), chosen by its own KVzip scores;
    the total is the budget's, and the kept entries differ from the global ranking's."""
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama"))
    path = uneven_schedule(model, tmp_path / "uneven.json")
    ctx, full = compress(model, tok, f"kvzip[schedule={path}]", 0.3)
    n = full.get_seq_length()
    budget = Budget.parse(0.3).count(n)
    lengths = {i: layer.row_lengths()[0].tolist() for i, layer in ctx.cache.folded_layers}
    sinks = 4
    rest = budget * 4 - sinks * 4  # two layers of two heads, four sinks each
    shares = [[0.5, 0.1], [0.3, 0.1]]
    for j, (i, _) in enumerate(ctx.cache.folded_layers):
        for h in range(2):
            assert abs(lengths[i][h] - sinks - shares[j][h] * rest) <= 1  # apportioned: rounding only
    assert sum(sum(v) for v in lengths.values()) == budget * 4
    scores = ctx.memo["kvzip_scores"]
    for (i, layer), (_, source) in zip(ctx.cache.folded_layers, full.folded_layers, strict=True):
        kept, _, _, count = layer.padded()
        for h in range(2):
            rows = source.keys[0, h]
            picked = [int((rows == key).all(-1).nonzero()[0]) for key in kept[0, h, : int(count[0, h])]]
            ranked = scores[i][0, h].clone()
            ranked[:sinks] = float("inf")
            assert sorted(picked) == sorted(ranked.topk(len(picked)).indices.tolist())
    plain, _ = compress(model, tok, "kvzip", 0.3)
    default = {i: layer.row_lengths()[0].tolist() for i, layer in plain.cache.folded_layers}
    assert default != lengths


def test_a_schedule_is_checked_against_the_model_and_the_other_budget_options(tmp_path):
    tok = TextTokenizer()
    model = kvfold.enable(tiny("llama"))
    path = uneven_schedule(kvfold.enable(make_tiny_model("qwen2")), tmp_path / "other.json")
    with pytest.raises(ValueError, match="computed for"):
        compress(model, tok, f"kvzip[schedule={path}]")
    with pytest.raises(SpecError, match="schedule and layerwise"):
        build_method(f"kvzip[schedule={path},layerwise=true]")


@pytest.mark.skipif(
    not triton_attention.available() or not (torch.cuda.is_available() or triton_attention.interpreted()),
    reason="no Triton, or no GPU and Triton's interpreter not chosen before Triton was imported (tests/conftest.py)",
)
@pytest.mark.parametrize(
    "spec", ["kvzip[chunk=24,scope=all]", "kvzip[chunk=24,scope=chunk]", "kvzip[chunk=24,plus=true]"]
)
def test_kvzip_through_the_scores_kernel_scores_and_keeps_as_the_pytorch_path(monkeypatch, spec):
    """A bfloat16 model's KVzip with its scores taken by the Triton kernel (as a GPU takes them in 16 bits;
    here under Triton's interpreter): the whole context's, each chunk's and KVzip+'s scores equal the PyTorch
    path's to float32 rounding, and the same entries are kept."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama").to(torch.bfloat16))
    text = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 3
    calls = []
    real = key_scores.fused_max_logits
    monkeypatch.setattr(key_scores, "fused_max_logits", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for forced in (False, True):
        monkeypatch.setattr(key_scores, "FUSED_FORCED", forced)
        runs[forced] = compress(model, tok, spec, 0.3, text)[0]
    assert calls  # the kernel scored (every forward of the repeat pass, with FUSED_FORCED)
    for layer_idx, want in runs[False].memo["kvzip_scores"].items():
        torch.testing.assert_close(runs[True].memo["kvzip_scores"][layer_idx], want, rtol=1e-5, atol=0)
    kept = [held_keys(runs[forced].cache) for forced in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))
