"""KeepKV's layer-batched decode step: the same cache as the per-layer step."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext
from kvfold.methods.merging.keepkv.decode import LayerBatchedDecode
from kvfold.methods.merging.keepkv.online import LayerPolicies
from kvfold.runtime.budget import Budget
from tests.conftest import make_tiny_model
from tests.runtime.test_attention import _CharTokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog; " * 3, "pack my box with five dozen liquor jugs now " * 3]
"""Two contexts of one length: decoding a batch needs equal rows (a padded batch decodes row by row)."""


def _decode(model, pre, compressed, batched: bool, tokens: list[list[int]]):
    """Feed the same tokens to a copy of the compressed cache under a fresh KeepKV policy."""
    cache = compressed.cache.copy()
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=pre.attention_mask,
                             budget=compressed.budget)  # fmt: skip
    policy = compressed.method.online_policy(ctx)
    assert isinstance(policy, LayerPolicies) and isinstance(policy.batched, LayerBatchedDecode)
    steps = []
    if batched:
        real_step = policy.batched.step
        policy.batched.step = lambda items: steps.append(real_step(items)) or steps[-1]
    else:
        policy.batched = None
    cache.policy = policy
    rows = pre.input_ids.shape[0]
    with torch.inference_mode():
        for ids in tokens:
            step = torch.tensor(ids).view(1, -1).expand(rows, -1)
            start = cache.get_seq_length()
            positions = torch.arange(start, start + step.shape[1]).expand(rows, -1)
            model(input_ids=step, position_ids=positions, past_key_values=cache)
    return cache, policy, steps


@pytest.mark.parametrize(("family", "spec"), [("llama", "keepkv"), ("qwen3", "keepkv[threshold=-1,alpha=0.5]")])
def test_the_batched_step_leaves_the_cache_of_the_per_layer_step(family, spec):
    model = kvfold.enable(make_tiny_model(family, num_hidden_layers=3))
    pre = kvfold.prefill(model, _CharTokenizer(), TEXTS, use_chat_template=False, methods="keepkv")
    compressed = pre.compress(spec, 0.4)
    tokens = [[5]] + [[7 + i] for i in range(8)]  # the first step is per layer (no state yet)
    per_layer, slow, _ = _decode(model, pre, compressed, False, tokens)
    batched, fast, steps = _decode(model, pre, compressed, True, tokens)
    assert steps.count(True) == len(tokens) - 1  # every step after the first ran batched
    for (_, a), (_, b) in zip(per_layer.folded_layers, batched.folded_layers, strict=True):
        assert a.physical_length == b.physical_length
        ka, va, beta_a = a.dense_buffers()
        kb, vb, beta_b = b.dense_buffers()
        torch.testing.assert_close(beta_b, beta_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kb, ka, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vb, va, rtol=1e-4, atol=1e-5)
    assert fast.folder.report() == pytest.approx(slow.folder.report(), rel=1e-6)
    assert fast.steps == slow.steps == len(tokens)
    for layer_idx, layer in batched.folded_layers:  # the per-layer views still hold the state
        n = layer.physical_length
        for name in ("_log_sum", "_weight", "_key_norm"):
            got, want = getattr(fast.folder, name)[layer_idx], getattr(slow.folder, name)[layer_idx]
            torch.testing.assert_close(got[..., :n], want[..., :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast.policies[layer_idx]._state[layer_idx][..., :n],
                                   slow.policies[layer_idx]._state[layer_idx][..., :n])  # fmt: skip


def test_a_longer_forward_falls_back_to_the_per_layer_step_and_stacks_again():
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, _CharTokenizer(), TEXTS[:1], use_chat_template=False, methods="keepkv")
    compressed = pre.compress("keepkv", 0.4)
    tokens = [[5], [6], [7, 8, 9], [10], [11]]
    per_layer, _, _ = _decode(model, pre, compressed, False, tokens)
    batched, fast, steps = _decode(model, pre, compressed, True, tokens)
    # the 3-token forward runs per layer and grows the state beyond the stack: the next step runs
    # per layer too and stacks it again, the one after is batched
    assert steps == [False, True, False, True]
    for (_, a), (_, b) in zip(per_layer.folded_layers, batched.folded_layers, strict=True):
        torch.testing.assert_close(b.dense_buffers()[0], a.dense_buffers()[0], rtol=1e-4, atol=1e-5)
    assert all(layer.physical_length == fast.policies[i].limits[i] for i, layer in batched.folded_layers)


def test_export_state_steps_a_forward_that_stopped_early():
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, _CharTokenizer(), TEXTS[:1], use_chat_template=False, methods="keepkv")
    compressed = pre.compress("keepkv", 0.4)
    cache = compressed.cache.copy()
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=None,
                             budget=Budget.parse(0.4))  # fmt: skip
    policy = compressed.method.online_policy(ctx)
    cache.policy = policy
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), past_key_values=cache)
        layer = cache.layers[0]
        query = torch.zeros(1, 6, 1, 16)
        keys, values, _ = layer.dense_buffers()
        layer.update(keys[:, :, :1].clone(), values[:, :, :1].clone())  # one more entry, held at layer 0 only
        logits = torch.zeros(1, 2, 3, layer.physical_length)
        policy.after_forward(0, layer, query, torch.softmax(logits, -1).reshape(1, 6, 1, -1), logits)
        assert layer.physical_length == policy.policies[0].limits[0] + 1  # held
        policy.export_state(cache)
    assert layer.physical_length == policy.policies[0].limits[0]
