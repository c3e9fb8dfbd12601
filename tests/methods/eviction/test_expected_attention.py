"""Expected Attention's scores and RoPE tables against transformers and a loop reference."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvfold.methods.core.scoring import pool_gqa
from kvfold.methods.core.selection import topk_keep
from kvfold.methods.eviction.expected_attention import expected_attention_scores, mean_rope_rotation, rope_cos_sin
from tests.methods.core.references import F64, kept, left_padding, make, ref_keep_all


def llama_rotary(d=8):
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, rope_theta=100.0)
    return LlamaRotaryEmbedding(cfg)


def test_rope_cos_sin_and_rotation_match_transformers():
    rotary = llama_rotary()
    pos = torch.arange(7, 12)
    cos_hf, sin_hf = rotary(torch.zeros(1, 5, 8), pos[None])
    cos, sin = rope_cos_sin(rotary.inv_freq, pos, rotary.attention_scaling)
    torch.testing.assert_close(cos, cos_hf[0])
    torch.testing.assert_close(sin, sin_hf[0])
    x = torch.randn(1, 1, 1, 8)
    for t in range(5):  # one position: R̄ is that position's rotation
        rotated, _ = apply_rotary_pos_emb(x, x, cos[t : t + 1], sin[t : t + 1], unsqueeze_dim=0)
        torch.testing.assert_close(mean_rope_rotation(cos[t : t + 1], sin[t : t + 1]) @ x[0, 0, 0], rotated[0, 0, 0])


def ref_expected(qpre, k, v, cos, sin, scaling, eps, valid):
    batch, hq, m, d = qpre.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    # R_t from transformers' own apply_rotary_pos_emb on the basis vectors
    eye = torch.eye(d, dtype=F64)[None, None]
    rots = []
    for t in range(cos.shape[0]):
        rotated, _ = apply_rotary_pos_emb(eye, eye, cos[t : t + 1], sin[t : t + 1], unsqueeze_dim=0)
        rots.append(rotated[0, 0].T)  # column j = R_t e_j
    r_bar = sum(rots) / len(rots)
    out = torch.zeros(batch, hkv, n, dtype=F64)
    for b in range(batch):
        for kv in range(hkv):
            per_head = []
            for gi in range(groups):
                h = kv * groups + gi
                mu = sum(qpre[b, h, i] for i in range(m)) / m
                sigma = sum(torch.outer(qpre[b, h, i] - mu, qpre[b, h, i] - mu) for i in range(m)) / m
                mu_bar, sigma_bar = r_bar @ mu, r_bar @ sigma @ r_bar.T
                z = {}
                for j in range(n):
                    if valid[b, kv, j]:
                        kj = k[b, kv, j]
                        z[j] = scaling * float(mu_bar @ kj) + 0.5 * scaling**2 * float(kj @ sigma_bar @ kj)
                top = max(z.values())
                total = sum(math.exp(x - top) for x in z.values())
                per_head.append({j: math.exp(x - top) / total for j, x in z.items()})
            for j in range(n):
                if not valid[b, kv, j]:
                    out[b, kv, j] = -math.inf
                    continue
                a = sum(p[j] for p in per_head) / groups
                out[b, kv, j] = (a + eps) * float(v[b, kv, j].norm())
    return out


@pytest.mark.parametrize("groups", [2, 3])
def test_expected_attention_matches_reference(groups):
    g = torch.Generator().manual_seed(30 + groups)
    qpre = torch.randn(2, 2 * groups, 7, 8, generator=g, dtype=F64)
    _, k, v = make(groups=groups, n=18, seed=31)
    rotary = llama_rotary()
    cos, sin = rope_cos_sin(rotary.inv_freq.double(), torch.arange(18, 18 + 16))
    valid = left_padding(2, 2, 18, [0, 3])
    got = expected_attention_scores(qpre, k, v, cos, sin, 8**-0.5, epsilon=1e-2, valid=valid)
    ref = ref_expected(qpre, k, v, cos, sin, 8**-0.5, 1e-2, valid)
    torch.testing.assert_close(got, ref)
    keep, lengths = topk_keep(got, 6, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(ref, 6, valid=valid)
    # batched tables (B, T, D), as a rotary module returns them, give the same
    got_b = expected_attention_scores(
        qpre,
        k,
        v,
        cos[None].expand(2, -1, -1),
        sin[None].expand(2, -1, -1),
        8**-0.5,
        epsilon=1e-2,
        valid=valid,
    )
    torch.testing.assert_close(got_b, got)


def test_expected_attention_single_query_single_position_is_true_attention():
    """Σ = 0 and one future position: the expectation is the attention of that rotated query."""
    g = torch.Generator().manual_seed(8)
    qpre = torch.randn(1, 4, 1, 8, generator=g, dtype=F64)
    _, k, v = make(batch=1, groups=2, n=10)
    rotary = llama_rotary()
    cos, sin = rope_cos_sin(rotary.inv_freq.double(), torch.tensor([10]))
    q_rot, _ = apply_rotary_pos_emb(qpre, qpre, cos, sin, unsqueeze_dim=0)
    true = pool_gqa(
        torch.softmax(torch.einsum("bhd,bhnd->bhn", q_rot[:, :, 0], k.repeat_interleave(2, 1)) * 0.3, -1), 2
    )
    got = expected_attention_scores(qpre, k, v, cos, sin, 0.3, use_value_norm=False)
    torch.testing.assert_close(got, true)
