"""H2O's accumulated attention against a loop reference, by chunks and step by step."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.core.scoring import window_attention
from kvfold.methods.core.selection import topk_keep
from kvfold.methods.eviction.h2o import h2o_scores, h2o_update
from tests.methods.core.references import F64, kept, left_padding, make, ref_keep_all, ref_probs


@pytest.mark.parametrize("groups", [2, 3])
def test_h2o_matches_reference_and_chunking(groups):
    q, k, _ = make(groups=groups, n=16, w=16, seed=20 + groups)
    valid = left_padding(2, 2, 16, [0, 4])
    ref_p = ref_probs(q, k, 0.3, valid=valid)
    ref = torch.zeros(2, 2, 16, dtype=F64)
    for b in range(2):
        for kv in range(2):
            for j in range(16):
                ref[b, kv, j] = sum(float(ref_p[b, kv * groups + g, :, j].sum()) for g in range(groups))
                if not valid[b, kv, j]:
                    ref[b, kv, j] = -math.inf
    full = h2o_scores(q, k, 0.3, chunk=1000, valid=valid)
    torch.testing.assert_close(full, ref)
    for chunk in (1, 3, 7):
        torch.testing.assert_close(h2o_scores(q, k, 0.3, chunk=chunk, valid=valid), full)
    keep, lengths = topk_keep(full, 5, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(ref, 5, valid=valid)


def test_h2o_update_continues_the_prefill_accumulator():
    q, k, _ = make(n=12, w=12, seed=3)
    prefix = h2o_scores(q[:, :, :11], k[:, :, :11], 0.3)
    step = window_attention(q[:, :, 11:], k, 0.3)  # the new token attends all 12 keys
    torch.testing.assert_close(h2o_update(prefix, step), h2o_scores(q, k, 0.3))
