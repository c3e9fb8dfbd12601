"""The features and statistics of a group of Attention Matching problems (:mod:`.features`):
the max-shifted exp-scores of App. A.2 and the statistics of highest-attention selection (§3.3)."""

from __future__ import annotations

import torch

from kvfold.methods.compaction.attention_matching import features


def test_block_statistics_a_few_problems_at_a_time_equal_all_at_once(monkeypatch):
    """Highest-attention selection's statistics (§3.3, App. F.1) bit for bit whatever the number of
    problems whose features are held at once."""
    torch.manual_seed(1)
    keys, values = torch.randn(7, 40, 8), torch.randn(7, 40, 8)
    beta0 = torch.zeros(7, 40)
    beta0[:, :3] = float("-inf")
    queries, valid = torch.randn(7, 300, 8), torch.rand(7, 300) > 0.1
    scaling = torch.full((7,), 8**-0.5)
    monkeypatch.setattr(features, "STATISTICS_BYTES", 1 << 40)
    together = features.block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    monkeypatch.setattr(features, "STATISTICS_BYTES", 2 * 64 * 40 * 4)  # two problems at a time
    apart = features.block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    for a, b in zip(together, apart, strict=True):
        assert torch.equal(a, b)
