"""Loop-based references the scorer and selection tests share (explicit loops over b, h, n)."""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def ref_keep(scores_row, count, prot_row=None, valid_row=None) -> list[int]:
    """Obvious top-k: protected (most recent first), then score desc, ties lower position."""
    n = len(scores_row)
    valid = [True] * n if valid_row is None else [bool(v) for v in valid_row]
    prot = [False] * n if prot_row is None else [bool(p) and v for p, v in zip(prot_row, valid, strict=True)]

    def key(j):
        s = float(scores_row[j])
        s = -math.inf if math.isnan(s) else s
        if not valid[j]:
            return (2, 0.0, j)
        if prot[j]:
            return (0, -j, j)
        return (1, -s, j)

    order = sorted(range(n), key=key)
    return sorted(order[: min(int(count), sum(valid))])


def kept(keep, lengths) -> list[list[list[int]]]:
    return [[keep[b, h, : lengths[b, h]].tolist() for h in range(keep.shape[1])] for b in range(keep.shape[0])]


def ref_keep_all(scores, counts, protected=None, valid=None) -> list[list[list[int]]]:
    batch, heads, _ = scores.shape
    out = []
    for b in range(batch):
        row = []
        for h in range(heads):
            c = counts if isinstance(counts, int) else int(counts[b, h])
            row.append(
                ref_keep(
                    scores[b, h].tolist(),
                    c,
                    None if protected is None else protected[b, h].tolist(),
                    None if valid is None else valid[b, h].tolist(),
                )
            )
        out.append(row)
    return out


def ref_probs(q, k, scaling, log_mass=None, valid=None):
    """Attention of the last W tokens' queries, one (b, h, i, j) at a time."""
    batch, hq, width, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    out = torch.zeros(batch, hq, width, n, dtype=F64)
    for b in range(batch):
        for h in range(hq):
            kv = h // groups
            for i in range(width):
                pos = n - width + i
                if valid is not None and not valid[b, kv, pos]:
                    continue
                logits = {}
                for j in range(pos + 1):
                    if valid is None or valid[b, kv, j]:
                        z = scaling * float(q[b, h, i] @ k[b, kv, j])
                        logits[j] = z + (0.0 if log_mass is None else float(log_mass[b, kv, j]))
                if not logits:
                    continue
                m = max(logits.values())
                total = sum(math.exp(z - m) for z in logits.values())
                for j, z in logits.items():
                    out[b, h, i, j] = math.exp(z - m) / total
    return out


def make(batch=2, hkv=2, groups=2, n=24, w=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * groups, w, d, generator=g, dtype=F64)
    k = torch.randn(batch, hkv, n, d, generator=g, dtype=F64)
    v = torch.randn(batch, hkv, n, d, generator=g, dtype=F64)
    return q, k, v


def left_padding(batch, hkv, n, pads):
    valid = torch.ones(batch, hkv, n, dtype=torch.bool)
    for b, p in enumerate(pads):
        valid[b, :, :p] = False
    return valid
