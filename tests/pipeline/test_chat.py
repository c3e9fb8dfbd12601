"""ChatSession: a conversation in a cache of fixed size; compaction of compacted caches (saving and
loading a chat: tests/store/test_chat.py)."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods.core import repeat
from kvfold.pipeline.chat import ChatSession, compact_history
from tests.conftest import CharTokenizer, make_tiny_model

DOC = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 3
QUESTIONS = [f"question number {i}, about item {i * 7}?" for i in range(10)]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _model(family: str = "llama"):
    return kvfold.enable(make_tiny_model(family))


def _rows(cache: kvfold.FoldedCache) -> list[torch.Tensor]:
    return [layer.row_lengths() for _, layer in cache.folded_layers]


@pytest.mark.parametrize(
    "family,method",
    [
        ("llama", "snapkv"),
        ("qwen2", "snapkv"),
        ("llama", "snapkv+keepkv"),
        ("llama", "am_highest_fast"),
        ("qwen2", "am_highest_fast"),
        ("llama", "h2o"),
        ("llama", "zsmerge"),
        ("llama", "streamingllm"),
    ],
)
def test_a_chat_past_its_cap_keeps_exactly_its_budget(family, method, monkeypatch):
    model = _model(family)
    budget, cap = 24, 128
    chat = ChatSession(model, CharTokenizer(), method, budget, cap=cap, max_new_tokens=5)
    compacted_rows, kept = [], []
    real = compact_history

    def spy(cache, *args, keep_last=0, **kwargs):
        done = real(cache, *args, keep_last=keep_last, **kwargs)
        if done:  # every row's history right after the compaction (the kept last turn excluded)
            compacted_rows.append([rows - keep_last for rows in _rows(cache)])
            kept.append(keep_last)
        return done

    monkeypatch.setattr("kvfold.pipeline.chat.compact_history", spy)
    for question in QUESTIONS:
        chat.ask(question)
        assert chat.physical_length() <= cap
        if chat.online:  # the policy holds every layer at its budget inside every forward
            assert all(bool((rows == budget).all()) for rows in _rows(chat.cache))
    stats = chat.stats()
    assert stats["turns"] == len(QUESTIONS)
    assert stats["logical_tokens"] > 2 * cap  # it ran past its cap several times
    assert compacted_rows and all(bool((r == budget).all()) for rows in compacted_rows for r in rows)
    if chat.online:
        assert stats["compactions"] == 1 and stats["entries"] == budget
    else:
        assert stats["compactions"] == len(compacted_rows) >= 3
        assert all(k > 0 for k in kept[1:])  # all but the last turn (the first: the last turn alone)
    assert stats["bytes"] < stats["full_bytes"] and stats["ratio"] == stats["bytes"] / stats["full_bytes"]


@pytest.mark.parametrize("method", ["kvzip+am_fit", "kvzip"])
def test_the_recommended_pipeline_recompacts_a_chat_by_repeat_passes_within_its_cap(method, monkeypatch):
    model = _model()
    budget, cap = 24, 128
    chat = ChatSession(model, CharTokenizer(), method, budget, cap=cap, max_new_tokens=5)
    passes = []
    real = repeat.repeat_pass

    def counted(ctx, *args, **kwargs):  # the pass replays every token the cache stands for, against it
        layers = ctx.cache.folded_layers
        logical = layers[0][1].logical_length
        assert ctx.input_ids[0].tolist() == chat.token_ids[:logical]
        passes.append(max(layer.physical_length for _, layer in layers) < logical)  # a compacted cache
        return real(ctx, *args, **kwargs)

    monkeypatch.setattr(repeat, "repeat_pass", counted)
    history = []
    real_compact = compact_history

    def spy(cache, *args, keep_last=0, **kwargs):
        done = real_compact(cache, *args, keep_last=keep_last, **kwargs)
        if done:  # the history's entries over every layer and head, the last turn kept whole excluded
            history.append([rows - keep_last for rows in _rows(cache)])
        return done

    monkeypatch.setattr("kvfold.pipeline.chat.compact_history", spy)
    for question in QUESTIONS:
        chat.ask(question)
        assert chat.physical_length() <= cap
    stats = chat.stats()
    assert stats["logical_tokens"] > 2 * cap and stats["compactions"] == len(history) >= 3
    assert len(passes) == stats["compactions"] and all(passes[1:])  # one pass a compaction, over compacted entries
    for rows in history:  # KVzip spreads the budget over layers and heads: on average, exactly the budget
        assert sum(int(r.sum()) for r in rows) == budget * sum(r.numel() for r in rows)
        assert max(int(r.max()) for r in rows) <= cap
    assert stats["bytes"] < stats["full_bytes"]
    betas = [layer.padded()[2] for _, layer in chat.cache.folded_layers]
    fitted = any(bool((beta[torch.isfinite(beta)].abs() > 1e-3).any()) for beta in betas)
    assert fitted == (method == "kvzip+am_fit")  # am_fit's β; KVzip keeps entries as they are


def _conversation_betas(cache, pinned) -> torch.Tensor:
    """β of every valid entry after the first ``pinned`` of its row (the conversation's), flat."""
    found = []
    for i, layer in cache.folded_layers:
        log_mass = layer.padded()[2][0]
        for h in range(log_mass.shape[0]):
            found.append(log_mass[h][torch.isfinite(log_mass[h])][int(pinned[i][0, h]) :])
    return torch.cat(found)


def _document_keys(cache, pinned) -> dict[int, list[torch.Tensor]]:
    """Per layer, per KV head, the keys, values and β of the row's first ``pinned`` valid entries
    (one tensor ``(n, 2D + 1)``)."""
    out = {}
    for i, layer in cache.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        entries = torch.cat([keys, values, log_mass[..., None].to(keys.dtype)], dim=-1)
        out[i] = [entries[0, h][valid[0, h]][: int(pinned[i][0, h])].clone() for h in range(keys.shape[1])]
    return out


@pytest.mark.parametrize("method", ["kvzip+am_fit", "kvzip"])
def test_a_chat_about_a_document_keeps_the_compressed_document_through_every_compaction(method):
    """``pin_context`` (the default): the document is compressed to the budget before the first
    question and its entries stay, keys, values and β bit for bit (``am_fit`` leaves them
    unfitted), through every later compaction of the conversation, within the cap; compactions
    leave room for more than one turn. Unpinned, the conversation's compactions re-rank the
    document and drop some of its entries."""
    model, tok = kvfold.enable(make_tiny_model("llama", max_position_embeddings=2048)), CharTokenizer()
    document = "the keeper logged the tide, the wind and the lamp at dawn; the gull came back. " * 5
    budget, cap = 40, 160
    chat = ChatSession(model, tok, method, budget, cap=cap, context=document, max_new_tokens=5)
    assert chat.compactions == 1 and chat.pinned is not None
    pinned = {i: p.clone() for i, p in chat.pinned.items()}
    assert sum(int(p.sum()) for p in pinned.values()) == budget * sum(p.numel() for p in pinned.values())
    before = _document_keys(chat.cache, pinned)
    for question in QUESTIONS:
        chat.ask(question)
        assert chat.physical_length() <= cap
    assert 3 <= chat.compactions - 1 < len(QUESTIONS)
    after = _document_keys(chat.cache, pinned)
    assert all(torch.equal(a, b) for i in before for a, b in zip(before[i], after[i], strict=True))
    state, tensors = chat.checkpoint()
    again = ChatSession.resume(model, tok, method, chat.cache, chat.token_ids, state=state, turn_queries=tensors)
    assert all(torch.equal(again.pinned[i], pinned[i]) for i in pinned)
    if method == "kvzip+am_fit":  # the conversation is selected, not refitted, unless asked
        assert _conversation_betas(chat.cache, pinned).abs().max() == 0
        refit = ChatSession(model, tok, method, budget, cap=cap, context=document, max_new_tokens=5)
        refit.refit_conversation = True
        for question in QUESTIONS[:6]:
            refit.ask(question)
        assert _conversation_betas(refit.cache, pinned).abs().max() > 1e-3

    loose = ChatSession(model, tok, method, budget, cap=cap, context=document, max_new_tokens=5, pin_context=False)
    loose.ask(QUESTIONS[0])
    first = {i: layer.row_lengths() for i, layer in loose.cache.folded_layers}
    start = _document_keys(loose.cache, {i: r - 0 for i, r in first.items()})
    for question in QUESTIONS[1:]:
        loose.ask(question)
    kept = _document_keys(loose.cache, first)
    assert any(not torch.equal(a, b) for i in start for a, b in zip(start[i], kept[i], strict=True))


def _beta_cache(model):
    """A cache compacted by a merging method: entries carry β ≠ 0."""
    context = kvfold.prefill(
        model, CharTokenizer(), "merged entries carry their log-mass " * 4, use_chat_template=False
    )
    compressed = context.compress("snapkv+keepkv", 0.5)
    cache = compressed.cache
    assert any(bool((layer.padded()[2].abs() > 1e-3).any()) for _, layer in cache.folded_layers)
    return cache, context.input_ids


def _snapshot(cache) -> list:
    return [tuple(t.clone() for t in layer.padded()) + (layer.logical_length,) for _, layer in cache.folded_layers]


@pytest.mark.parametrize("method", ["snapkv", "snapkv+keepkv", "am_highest_fast"])
@pytest.mark.parametrize("keep_last", [0, 6])
def test_compacting_a_compacted_cache_within_its_budget_changes_nothing(method, keep_last):
    model = _model()
    cache, ids = _beta_cache(model)
    before = _snapshot(cache)
    size = max(int(layer.row_lengths().max()) for _, layer in cache.folded_layers)
    for budget in (size, size + 10):
        done = compact_history(cache, model, kvfold.build_method(method), budget, ids, keep_last=keep_last)
        assert done is False
        for (k, v, lm, n, logical), (k2, v2, lm2, n2, logical2) in zip(before, _snapshot(cache), strict=True):
            assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(lm, lm2) and torch.equal(n, n2)
            assert logical == logical2


def test_compaction_carries_the_beta_of_kept_entries_and_the_last_turn_whole():
    model = _model()
    cache, ids = _beta_cache(model)
    before = _snapshot(cache)
    keep_last, budget = 6, 20
    assert compact_history(cache, model, kvfold.build_method("snapkv"), budget, ids, keep_last=keep_last)
    carried_nonzero = 0
    for (k, v, lm, _, logical), (_, layer) in zip(before, cache.folded_layers, strict=True):
        k2, v2, lm2, n2 = layer.padded()
        assert layer.logical_length == logical
        assert bool((n2 == budget + keep_last).all())
        # the last turn is put back unchanged, after the history
        assert torch.equal(k2[:, :, -keep_last:], k[:, :, -keep_last:])
        assert torch.equal(v2[:, :, -keep_last:], v[:, :, -keep_last:])
        assert torch.equal(lm2[:, :, -keep_last:], lm[:, :, -keep_last:])
        # every history entry is an entry of the compacted cache, with its β (a selector keeps them as they are)
        for b in range(k.shape[0]):
            for h in range(k.shape[1]):
                for j in range(budget):
                    match = (k[b, h, :-keep_last] == k2[b, h, j]).all(-1).nonzero().flatten()
                    assert match.numel() == 1
                    src = int(match[0])
                    assert torch.equal(v[b, h, src], v2[b, h, j]) and lm[b, h, src] == lm2[b, h, j]
                    carried_nonzero += int(abs(float(lm2[b, h, j])) > 1e-3)
    assert carried_nonzero > 0  # β ≠ 0 entries were kept, their β carried


def test_the_query_window_of_a_compaction_is_the_historys_own(monkeypatch):
    model = _model()
    chat = ChatSession(model, CharTokenizer(), "snapkv", 24, cap=128, max_new_tokens=4)
    seen = {}

    def spy(cache, *args, window_queries=None, keep_last=0, **kwargs):
        seen["window"] = window_queries
        seen["keep_last"] = keep_last
        return compact_history(cache, *args, window_queries=window_queries, keep_last=keep_last, **kwargs)

    monkeypatch.setattr("kvfold.pipeline.chat.compact_history", spy)
    snapshot = None
    for question in QUESTIONS:
        before = {i: layer.captured_queries for i, layer in chat.cache.folded_layers}
        chat.ask(question)
        if seen.get("keep_last"):  # this turn compacted all but the last: with the last turn's start window
            assert all(seen["window"][i] is snapshot[i] for i in snapshot)
            break
        snapshot = before
    assert seen["keep_last"] > 0


@pytest.mark.parametrize(
    "method,message",
    [
        ("adakv:snapkv", "freshly prefilled context only"),
        ("adakv:kvzip", "freshly prefilled context only"),
        ("h2o[online=false]", "online=true"),
    ],
)
def test_methods_that_cannot_compact_a_conversation_are_refused(method, message):
    with pytest.raises(ValueError, match=message):
        ChatSession(_model(), CharTokenizer(), method, 24)


def test_bad_budgets_and_caps_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="token count"):
        ChatSession(model, CharTokenizer(), "snapkv", 0.1)
    with pytest.raises(ValueError, match="must exceed the budget"):
        ChatSession(model, CharTokenizer(), "snapkv", 32, cap=32)
    chat = ChatSession(model, CharTokenizer(), "snapkv", 32, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        chat.ask("  ")
    with pytest.raises(ValueError, match="positions"):
        chat.ask("x" * 600)


def test_turns_follow_the_chat_template():
    class Tok:
        chat_template = CHATML

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            from jinja2 import Template

            return Template(CHATML).render(messages=messages, add_generation_prompt=add_generation_prompt)

    chat = ChatSession.__new__(ChatSession)
    chat.tokenizer, chat.use_chat_template, chat.system = Tok(), True, None
    chat.context_open, chat.messages = False, []
    chat.cache = kvfold.FoldedCache(num_layers=1)
    first = chat._turn_text("Hi")
    assert (
        first
        == "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    chat.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert chat._turn_text("Bye") == "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.model
def test_a_long_chat_on_smollm2_still_answers_a_fact_of_its_first_turn(smollm2):
    """H2O keeps the fact through a compaction and 6 turns of online eviction at 96 entries.

    A regression check, not a proof of retention: on SmolLM2-135M the *full* cache loses this fact
    after the same filler turns (it answers the last question's topic), so only the answer of this
    method, greedy and deterministic, is pinned.
    """
    model, tokenizer = smollm2
    chat = ChatSession(model, tokenizer, "h2o", 96, cap=192, max_new_tokens=16)
    first = chat.ask("The password for the lighthouse is 4821. What is the password for the lighthouse?")
    assert "4821" in first
    for question in ["Name a color.", "What is 2 plus 3?", "Name an animal.", "Say hello.", "Name a fruit."]:
        chat.ask(question)
    answer = chat.ask("What is the password for the lighthouse?")
    stats = chat.stats()
    assert stats["compactions"] == 1 and stats["entries"] == 96 and stats["logical_tokens"] > 192
    assert "4821" in answer


@pytest.mark.parametrize("method", ["kvzip@int4", "kvzip+am_fit@int4", "knorm[online=false]@int3"])
def test_a_quantized_chat_stores_every_compaction_quantized_and_counts_its_bytes(method):
    """Every compaction stores the conversation in the method's format; new turns are appended in
    full precision in between; the bytes held are the quantized ones."""
    chat = ChatSession(_model(), CharTokenizer(), method, budget=60, cap=120, context=DOC)
    for _ in range(3):
        chat.ask("what is the code? " * 2, max_new_tokens=6)
    assert chat.compactions >= 2
    assert all(layer.is_quantized for _, layer in chat.cache.folded_layers)
    assert chat.cache.quant is not None and chat.cache.quant.format == method.split("@")[1]
    assert chat.cache.content_nbytes(sixteen_bit=True) < 0.5 * chat.cache.full_nbytes(sixteen_bit=True)


def test_a_quantized_chat_refuses_a_method_that_compresses_while_decoding():
    with pytest.raises(ValueError, match="compacted one-shot"):
        ChatSession(_model(), CharTokenizer(), "h2o@int4", budget=60, cap=120, context=DOC)
