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
    held = ReferenceQueries(torch.randn(1, 1, 4, 3, dtype=torch.bfloat16), torch.ones(1, 1, 4, dtype=torch.bool), chunk)
    assert held.on(torch.device("cpu")) is held
    moved = held.on(torch.device("meta"))
    assert moved.queries.device.type == moved.valid.device.type == "meta"
    assert (moved.queries.dtype, moved.valid.dtype, moved.queries.shape) == (torch.bfloat16, torch.bool, (1, 1, 4, 3))
    assert (moved.chunk is None) == (not with_chunks)
    if with_chunks:
        assert moved.chunk.device.type == "meta" and moved.chunk.dtype == torch.long
