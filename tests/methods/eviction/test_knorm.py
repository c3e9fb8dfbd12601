"""K-norm's scores: the negative key norm."""

from __future__ import annotations

import math

import torch

from kvfold.methods.core.selection import topk_keep
from kvfold.methods.eviction.knorm import knorm_scores
from tests.methods.core.references import kept, make, ref_keep_all


def test_knorm_keeps_low_norm_keys():
    _, k, _ = make(seed=5)
    got = knorm_scores(k)
    for b in range(2):
        for h in range(2):
            for j in range(24):
                assert math.isclose(float(got[b, h, j]), -math.sqrt(sum(float(x) ** 2 for x in k[b, h, j])))
    keep, lengths = topk_keep(got, 6)
    assert kept(keep, lengths) == ref_keep_all(got, 6)
    assert knorm_scores(k.half()).dtype == torch.float32
