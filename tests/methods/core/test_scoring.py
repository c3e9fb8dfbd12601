"""What the scorers share (window attention, GQA and token pooling, z-scores) against loop references."""

from __future__ import annotations

import pytest
import torch

from kvfold.methods.core.scoring import pool_gqa, pool_tokens, window_attention, zscore
from tests.methods.core.references import F64, left_padding, make, ref_probs

# ---------------------------------------------------------------------------- window attention


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_window_attention_matches_reference(groups):
    q, k, _ = make(groups=groups, seed=groups)
    log_mass = torch.rand(2, 2, 24, dtype=F64).log1p()
    valid = left_padding(2, 2, 24, [0, 5])
    got = window_attention(q, k, 0.35, log_mass=log_mass, valid=valid)
    assert got.shape == (2, 2 * groups, 6, 24)
    torch.testing.assert_close(got, ref_probs(q, k, 0.35, log_mass, valid))


def test_window_attention_is_causal_within_window():
    q, k, _ = make(n=20, w=5)
    probs = window_attention(q, k, 0.3)
    for i in range(5):
        assert probs[..., i, 20 - 5 + i + 1 :].abs().sum() == 0  # never sees a later token
        k2 = k.clone()
        k2[:, :, 20 - 5 + i + 1 :] += 10.0  # changing later keys leaves row i unchanged
        torch.testing.assert_close(window_attention(q, k2, 0.3)[..., i, :], probs[..., i, :])
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5, dtype=F64))


def test_window_attention_float32_and_padded_query_rows():
    q, k, _ = make(n=10, w=4)
    valid = left_padding(2, 2, 10, [0, 8])  # row 1: the first two window queries are padding
    probs = window_attention(q.float(), k.float(), 0.3, valid=valid)
    assert probs.dtype == torch.float32
    assert probs[1, :, :2].abs().max() == 0
    assert not torch.isnan(probs).any()


def test_pool_gqa_groups_consecutive_heads():
    x = torch.arange(12.0).reshape(1, 6, 2)  # 6 query heads, 2 KV heads -> groups {0,1,2}, {3,4,5}
    torch.testing.assert_close(pool_gqa(x, 2, "mean"), torch.tensor([[[2.0, 3.0], [8.0, 9.0]]]))
    torch.testing.assert_close(pool_gqa(x, 2, "max"), torch.tensor([[[4.0, 5.0], [10.0, 11.0]]]))
    torch.testing.assert_close(pool_gqa(x, 2, "sum"), torch.tensor([[[6.0, 9.0], [24.0, 27.0]]]))
    with pytest.raises(ValueError, match="multiple"):
        pool_gqa(x, 4)


def test_pool_tokens_edges_and_errors():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0]])
    torch.testing.assert_close(pool_tokens(x, 3, "max"), torch.tensor([[5.0, 5.0, 5.0, 3.0, 3.0]]))
    torch.testing.assert_close(pool_tokens(x, 3, "avg"), torch.tensor([[2.0, 8 / 3, 7 / 3, 5 / 3, 1.0]]))
    with pytest.raises(ValueError, match="odd"):
        pool_tokens(x, 4)


# ---------------------------------------------------------------------------- z-scores


def test_zscore_standardises_each_row_over_heads_and_valid_entries():
    scores = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, float("-inf")]]], dtype=F64)
    valid = torch.tensor([[[True, True, True], [True, True, False]]])
    z = zscore(scores, valid)
    ref = (torch.tensor([1.0, 2, 3, 4, 5], dtype=F64) - 3.0) / torch.tensor(2.0, dtype=F64).sqrt()
    torch.testing.assert_close(z[0][valid[0]], ref)
    assert bool(torch.isneginf(z[0, 1, 2]))
