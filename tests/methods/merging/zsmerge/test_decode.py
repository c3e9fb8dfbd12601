"""ZSMerge's layer-batched steady decode step: the same cache as the per-layer step."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext
from kvfold.methods.merging.zsmerge.online import ZSMergeOnline
from tests.conftest import make_tiny_model
from tests.runtime.test_attention import _CharTokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog; " * 3, "pack my box with five dozen liquor jugs now " * 3]


def _decode(model, pre, compressed, batched: bool, tokens: list[list[int]]):
    """Feed the same tokens to a copy of the compressed cache under a fresh ZSMerge policy."""
    cache = compressed.cache.copy()
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=pre.attention_mask,
                             budget=compressed.budget)  # fmt: skip
    policy = compressed.method.online_policy(ctx)
    assert isinstance(policy, ZSMergeOnline)
    steps = []
    real_step = policy._batch.step

    def spy(items) -> bool:
        steps.append(real_step(items) if batched else False)  # per layer: never batched
        return steps[-1]

    policy._batch.step = spy
    cache.policy = policy
    rows = pre.input_ids.shape[0]
    with torch.inference_mode():
        for ids in tokens:
            step = torch.tensor(ids).view(1, -1).expand(rows, -1)
            start = cache.get_seq_length()
            positions = torch.arange(start, start + step.shape[1]).expand(rows, -1)
            model(input_ids=step, position_ids=positions, past_key_values=cache)
    return cache, policy, steps


@pytest.mark.parametrize(
    ("family", "spec"),
    [("llama", "zsmerge"), ("qwen2", "zsmerge[residual=3,alpha=0.6]"), ("llama", "zsmerge[residual=3,slot_metric=l2]")],
)
def test_the_batched_step_leaves_the_cache_of_the_per_layer_step(family, spec):
    model = kvfold.enable(make_tiny_model(family, num_hidden_layers=3))
    pre = kvfold.prefill(model, _CharTokenizer(), TEXTS, use_chat_template=False, methods=spec)
    compressed = pre.compress(spec, 0.4)
    tokens = [[5 + i] for i in range(10)] + [[30, 31, 32]] + [[40 + i] for i in range(4)]
    per_layer, slow, _ = _decode(model, pre, compressed, False, tokens)
    batched, fast, steps = _decode(model, pre, compressed, True, tokens)
    assert steps.count(True) >= 8  # the steady steps ran batched (a 3-token forward never does)
    for (layer_idx, a), (_, b) in zip(per_layer.folded_layers, batched.folded_layers, strict=True):
        assert a.physical_length == b.physical_length
        for x, y in zip(b.dense_buffers(), a.dense_buffers(), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        got, want = fast.slots(layer_idx, b), slow.slots(layer_idx, a)
        for name in ("position", "slot_id", "count", "valid"):
            torch.testing.assert_close(got[name], want[name])
        torch.testing.assert_close(got["score"], want["score"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["residual_keys"], want["residual_keys"], rtol=1e-5, atol=1e-6)
    assert fast.steps == slow.steps == len(tokens)
