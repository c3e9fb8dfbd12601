"""Protection and top-k selection against a loop reference (ties, protection, padding)."""

from __future__ import annotations

import pytest
import torch

from kvfold.methods.core.selection import protected_mask, topk_keep
from tests.methods.core.references import kept, left_padding, ref_keep_all


def test_protected_mask_skips_left_padding():
    valid = left_padding(3, 2, 10, [0, 3, 9])
    valid[0, 1, 5] = False  # a hole in the middle (per-head layouts)
    mask = protected_mask(3, 2, 10, sinks=2, recent=3, valid=valid)
    for b in range(3):
        for h in range(2):
            pos = [j for j in range(10) if valid[b, h, j]]
            expect = set(pos[:2]) | set(pos[-3:])
            assert {j for j in range(10) if mask[b, h, j]} == expect
    assert protected_mask(1, 1, 5, sinks=1, recent=1).tolist() == [[[True, False, False, False, True]]]
    with pytest.raises(ValueError):
        protected_mask(1, 1, 5, sinks=-1)


@pytest.mark.parametrize("seed", range(4))
def test_topk_keep_matches_reference_with_ties_protection_and_padding(seed):
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.randint(0, 4, (3, 4, 15), generator=g).float()  # heavy ties
    scores[0, 0, 3] = float("nan")
    valid = torch.rand(3, 4, 15, generator=g) > 0.2  # arbitrary holes
    prot = (torch.rand(3, 4, 15, generator=g) > 0.8) & valid
    counts = torch.randint(0, 16, (3, 4), generator=g)
    keep, lengths = topk_keep(scores, counts, protected=prot, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(scores, counts, prot, valid)
    assert torch.equal(lengths, torch.minimum(counts, valid.sum(-1)))
    for b in range(3):
        for h in range(4):
            row = keep[b, h]
            length = int(lengths[b, h])
            assert row.tolist() == sorted(row.tolist())  # ascending, padded with the last kept index
            assert (row[length:] == (row[length - 1] if length else 0)).all()
            if length >= int(prot[b, h].sum()):
                assert set(torch.nonzero(prot[b, h]).flatten().tolist()) <= set(row[:length].tolist())
            assert valid[b, h, row[:length]].all()


def test_topk_keep_tie_rule_and_protected_overflow():
    keep, lengths = topk_keep(torch.ones(1, 1, 6), 3)
    assert keep.tolist() == [[[0, 1, 2]]]  # ties: lower position first
    prot = torch.tensor([[[True, True, False, False, True, True]]])
    keep, _ = topk_keep(torch.arange(6.0)[None, None], 3, protected=prot)
    assert keep.tolist() == [[[1, 4, 5]]]  # fewer slots than protected: the most recent protected
    keep, lengths = topk_keep(torch.zeros(2, 1, 4), torch.tensor([0, 2]))
    assert lengths.tolist() == [[0], [2]] and keep.tolist() == [[[0, 0]], [[0, 1]]]
    with pytest.raises(ValueError):
        topk_keep(torch.zeros(1, 1, 4), -1)


def test_padding_never_kept_ahead_of_valid_entries():
    scores = torch.full((1, 2, 8), -5.0)
    valid = left_padding(1, 2, 8, [5])
    scores[~valid] = 100.0  # even if a caller forgot to mask them
    keep, lengths = topk_keep(scores, 6, valid=valid)
    assert lengths.tolist() == [[3, 3]]
    assert keep[..., :3].tolist() == [[[5, 6, 7], [5, 6, 7]]]
