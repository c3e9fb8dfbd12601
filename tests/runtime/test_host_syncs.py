"""The host-synchronisation counter (kvfold.runtime.host_syncs): what it counts, and where."""

from __future__ import annotations

import torch

from kvfold.runtime import host_syncs
from kvfold.runtime.host_syncs import HostSyncCounter, is_host_sync


def test_every_host_read_is_counted_and_nothing_else():
    x = torch.arange(6.0)
    mask = x > 2
    with HostSyncCounter() as syncs:
        bool(x[0] > 1)
        int(x[1])
        float(x[2])
        x.tolist()
        x[0].item()
        x.nonzero()
        x[mask]
        y = x.clone()
        y[mask] = 0.0
        torch.repeat_interleave(torch.tensor([1, 2]))
        _ = [0, 1, 2][x.long()[1]]
    assert len(syncs.other) == 10 and sum(syncs.other.values()) == 10, syncs.summary()
    with HostSyncCounter() as syncs:  # shapes, views, arithmetic, index tensors: no value leaves the device
        z = (x * 2 + 1).view(2, 3).sum(-1)
        x.index_select(0, torch.tensor([1, 3]))
        x[torch.tensor([0, 2])]
        x.masked_fill(mask, 0.0)
        torch.where(mask, x, z.new_zeros(()))
        torch.repeat_interleave(x, torch.tensor([1] * 6), output_size=6)
        _ = x.shape[0] + z.numel()
    assert not syncs.other and not syncs.kvfold, syncs.summary()


def test_calls_are_told_apart_by_where_they_are_made(monkeypatch):
    """A call made in kvfold's source counts as ``kvfold``; one made elsewhere (here, the test) as
    ``other``."""
    x = torch.ones(3)
    with HostSyncCounter() as syncs:
        host_syncs.SYNCING  # noqa: B018 - nothing counted
        x.tolist()
        torch.tensor([3, 1]).max().item()
    assert not syncs.kvfold and sum(syncs.other.values()) == 2
    from kvfold.runtime.rows import FloatRows

    rows = FloatRows(torch.tensor([2, 1]), torch.zeros(3, 2), torch.zeros(3, 2), None)
    with HostSyncCounter() as syncs:
        rows.row_ranges()  # reads the lengths with .tolist() in kvfold's source
    assert sum(syncs.kvfold.values()) == 1 and "rows.py" in next(iter(syncs.kvfold))


def test_the_rule_reads_arguments():
    x = torch.arange(3)
    assert is_host_sync(torch.Tensor.__getitem__, (x, x > 0), {})
    assert not is_host_sync(torch.Tensor.__getitem__, (x, x), {})
    assert is_host_sync(torch.where, (x > 0,), {})
    assert not is_host_sync(torch.where, (x > 0, x, x), {})
