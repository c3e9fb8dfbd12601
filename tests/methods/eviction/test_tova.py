"""TOVA's scores: the last query's attention averaged over the layer's heads."""

from __future__ import annotations

import math

import torch

from kvfold.methods.core.selection import topk_keep
from kvfold.methods.eviction.tova import tova_scores
from tests.methods.core.references import F64, left_padding


def test_tova_is_head_averaged_last_query():
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(2, 6, 3, 10, generator=g, dtype=F64).softmax(-1)
    valid = left_padding(2, 2, 10, [0, 2])
    got = tova_scores(probs, 2, valid=valid)
    for b in range(2):
        for kv in range(2):
            for j in range(10):
                expect = sum(float(probs[b, h, -1, j]) for h in range(6)) / 6
                if valid[b, kv, j]:
                    assert math.isclose(float(got[b, kv, j]), expect, rel_tol=1e-12)
                else:
                    assert got[b, kv, j] == -math.inf
    keep, lengths = topk_keep(got, 4, valid=valid)
    assert torch.equal(keep[:, 0], keep[:, 1])  # one keep set per layer
