"""Reference queries (:mod:`kvfold.methods.compaction.attention_matching.queries`)."""

from __future__ import annotations

import pytest
import torch

from kvfold.methods.compaction.attention_matching.queries import ReferenceQueries


@pytest.mark.parametrize("with_chunks", [False, True])
def test_reference_queries_move_to_a_device_together(with_chunks):
    """A fit brings one layer's queries from the host to the cache's device: the queries, their validity
    and their chunks go together, in their dtypes; already there, nothing is copied."""
    chunk = torch.tensor([[[0, 0, 1, -1]]]) if with_chunks else None
    lse = torch.randn(1, 1, 4) if with_chunks else None
    held = ReferenceQueries(
        torch.randn(1, 1, 4, 3, dtype=torch.bfloat16), torch.ones(1, 1, 4, dtype=torch.bool), chunk, lse
    )
    assert held.on(torch.device("cpu")) is held
    moved = held.on(torch.device("meta"))
    assert moved.queries.device.type == moved.valid.device.type == "meta"
    assert (moved.queries.dtype, moved.valid.dtype, moved.queries.shape) == (torch.bfloat16, torch.bool, (1, 1, 4, 3))
    assert (moved.chunk is None) == (not with_chunks)
    assert (moved.context_lse is None) == (not with_chunks)
    if with_chunks:
        assert moved.chunk.device.type == "meta" and moved.chunk.dtype == torch.long
        assert moved.context_lse.device.type == "meta" and moved.context_lse.dtype == torch.float32


def test_each_querys_context_mass_follows_it_through_cat_subsample_and_sharing():
    """The repeat pass's mass over the context stays with its query: joined with queries of another
    source (NaN: not known), in a seeded subset, and when some queries are given to every chunk."""
    queries = torch.arange(6.0).reshape(1, 1, 6, 1)
    repeat = ReferenceQueries(
        queries, torch.ones(1, 1, 6, dtype=torch.bool), torch.tensor([[[0, 0, 0, 1, 1, 1]]]), queries[..., 0] * 10
    )
    other = ReferenceQueries(torch.full((1, 1, 2, 1), -1.0), torch.ones(1, 1, 2, dtype=torch.bool))
    both = repeat.cat(other)
    assert both.context_lse[0, 0, :6].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert bool(both.context_lse[0, 0, 6:].isnan().all())
    assert other.cat(repeat).context_lse[0, 0, 2:].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert other.cat(other).context_lse is None
    few = both.subsample(4, torch.Generator().manual_seed(0))
    kept = few.queries[0, 0, :, 0]
    expected = torch.where(kept >= 0, kept * 10, torch.full_like(kept, float("nan")))
    torch.testing.assert_close(few.context_lse[0, 0], expected, equal_nan=True)
    assert torch.equal(repeat.share_across_chunks(2).context_lse, repeat.context_lse)
