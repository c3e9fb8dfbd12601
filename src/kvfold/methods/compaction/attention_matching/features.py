"""Attention Matching's problems of one group: working precision, features and statistics.

Zweiger et al. 2026, "Fast KV Compaction via Attention Matching" (``papers/attention-matching.md``).
For a group of problems (each one block of a single KV head, see
:mod:`kvfold.methods.compaction.attention_matching.solve`): the features
``Φ_ij = exp(s·q_i·K_j + β⁰_j − shift_i)`` with the per-query max-shift of App. A.2 ("Stable
computation"), the target mass ``m_i = Σ_j Φ_ij`` and output ``Y = (Φ V) / m`` (eq. 1–2), and the
mean squared attention weights by which highest-attention selection ranks keys (§3.3, App. F.1);
computed a block of queries at a time, or by the fused attention kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfold.runtime import exact_products
from kvfold.runtime.attention import FLASH_WITH_LSE

Tensor = torch.Tensor

STATISTICS_BYTES = 4 << 20
"""Bytes of one ``(problems, query block, T)`` feature block of :func:`block_statistics`."""


def _logits(keys: Tensor, beta0: Tensor, queries: Tensor, scaling: Tensor) -> Tensor:
    """``ℓ = s·Q Kᵀ + β⁰`` ``(P, n, T)`` (β⁰ = −inf on empty slots), in β⁰'s precision: 16-bit queries and keys
    (a GPU's :class:`Group`) are multiplied with float32 sums (:func:`exact_products.float32_bmm`)."""
    if queries.dtype in exact_products.OPERAND_DTYPES:
        products = exact_products.float32_bmm(queries, keys.mT)
    else:
        products = torch.bmm(queries, keys.mT)
    return products.mul_(scaling[:, None, None]).add_(beta0[:, None, :])


def max_shifted_features(
    keys: Tensor, beta0: Tensor, queries: Tensor, query_valid: Tensor, scaling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``Φ = exp(ℓ − shift)`` with the per-query max-shift (App. A.2; invalid queries → zero rows),
    the mass ``m = Φ·1`` and the shift ``(P, n)``."""
    phi = _logits(keys, beta0, queries, scaling)
    shift = phi.amax(dim=-1)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    phi.sub_(shift[..., None]).exp_()  # App. A.2: exp(ℓ − max ℓ), in place
    if phi.device.type != "cpu" or not bool(query_valid.all()):  # on a GPU the read would cost more than the product
        phi.mul_(query_valid[..., None].to(phi.dtype))
    return phi, phi.sum(-1), shift


def block_statistics(
    keys: Tensor,
    values: Tensor,
    beta0: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    scaling: Tensor,
    block: int = 256,
    squares: bool = True,
    budget: int = STATISTICS_BYTES,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What highest-attention selection needs, one block of ``block`` queries and a few problems
    (``budget`` bytes of features) at a time: the shift ``(P, n)``, the mass ``m`` ``(P, n)``, the
    target ``Y = Φ V / m`` ``(P, n, D)`` and ``Σ_i a_ij² / n`` ``(P, T)`` with ``a_ij = Φ_ij / m_i``
    (the mean squared attention weight; zeros unless ``squares``: given keys need no selection
    score). Small blocks stay in a CPU's caches; a GPU takes large ones (fewer launches)."""
    P, n, _ = queries.shape
    shift = values.new_zeros(P, n)  # the working precision: the values' (queries and keys may be 16-bit)
    mass = values.new_zeros(P, n)
    target = values.new_zeros(P, n, values.shape[-1])
    square = values.new_zeros(P, keys.shape[1])
    n_valid = query_valid.sum(-1).clamp_min(1).to(values.dtype)
    # A few problems at a time: the (problems, block, T) features stay in cache through their
    # ten or so passes. Every operation is per problem, so the result is the same bit for bit.
    step = max(1, budget // max(1, block * keys.shape[1] * values.element_size()))
    for p0 in range(0, P, step):
        p1 = min(P, p0 + step)
        k, v, b0, sc = keys[p0:p1], values[p0:p1], beta0[p0:p1], scaling[p0:p1]
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            phi, m, s = max_shifted_features(k, b0, queries[p0:p1, lo:hi], query_valid[p0:p1, lo:hi], sc)
            safe = torch.where(m > 0, m, torch.ones_like(m))
            shift[p0:p1, lo:hi], mass[p0:p1, lo:hi] = s, m
            target[p0:p1, lo:hi] = torch.bmm(phi, v) / safe[..., None]  # eq. 1: exp(ℓ) V / Mass
            if squares:
                weights = (safe.pow(-2) / n_valid[p0:p1, None])[:, None, :]
                square[p0:p1] += torch.bmm(weights, phi.square_())[:, 0]
            del phi  # before the next block's: one block of features held, not two
    return shift, mass, target, square


def fused_statistics(
    keys: Tensor, values: Tensor, beta0: Tensor, queries: Tensor, query_valid: Tensor, scaling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The shift, mass and target of :func:`block_statistics` (no selection score) from the fused
    attention kernel: ``Y = softmax(s·Q Kᵀ + β⁰) V`` and each query's log-sum-exp ``lse_i``, taken
    as the shift, so ``Φ_ij = exp(ℓ_ij − lse_i)`` are the attention weights and ``m_i = 1``.
    With relative mass weighting (``Σ_i ((Φ_S w)_i / m_i − 1)²``) and the value fit on
    ``X = Φ_S w / (Φ_S w)·1`` the fit is the same as with App. A.2's max-shift, at half the time
    of the blocks of :func:`block_statistics` (no ``(n, T)`` features in memory either)."""
    P, n, _ = queries.shape
    mask = beta0[None, :, None, :].expand(1, P, n, beta0.shape[-1])
    target, lse = FLASH_WITH_LSE(
        queries[None], keys[None], values[None], 0.0, False, attn_mask=mask, scale=float(scaling[0])
    )
    valid = query_valid.to(queries.dtype)
    return lse[0].to(queries.dtype), valid, target[0] * valid[..., None]


def selected_features(
    keys: Tensor,
    beta0: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    scaling: Tensor,
    shift: Tensor,
    idx: Tensor,
    ok: Tensor,
) -> Tensor:
    """``Φ_S = exp(ℓ_S − shift)`` ``(P, n, t)`` for the kept keys only (zero on unused slots)."""
    k_s = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))
    b_s = beta0.gather(1, idx).masked_fill(~ok, -math.inf)
    phi_s = _logits(k_s, b_s, queries, scaling).sub_(shift[..., None]).exp_()
    return phi_s.mul_(query_valid[..., None].to(phi_s.dtype))


@dataclass
class Group:
    """The problems of one group in the working precision (float64 if keys or queries are, else
    float32): keys, values ``(P, T, D)``, β⁰ ``(P, T)`` (−inf = empty slot), queries ``(P, n, D)``,
    their validity ``(P, n)`` and logit scales ``(P,)``; ``compact_keys`` ``(P, T, D)``, when given,
    are the keys a kept entry will have in the compact cache (quantized, as stored) where ``keys``
    are the cache's own: the target is computed from ``keys``, the kept entries' features from
    ``compact_keys``, so the fit absorbs the difference; ``query_weight`` ``(P, n)``, when given,
    weighs each query's squared residuals (:func:`~.solve.fit_problems`).

    Where :func:`exact_products.applies` (a GPU, 16-bit queries and keys of one dtype) the queries and keys
    stay in 16 bits and only their logits are float32: the same products on tensor cores, and a group's
    queries in half the bytes. Everything else is in :attr:`dtype`."""

    keys: Tensor
    values: Tensor
    beta0: Tensor
    queries: Tensor
    query_valid: Tensor
    scaling: Tensor
    compact_keys: Tensor | None = None
    query_weight: Tensor | None = None

    @classmethod
    def prepare(
        cls,
        keys: Tensor,
        values: Tensor,
        log_mass: Tensor,
        queries: Tensor,
        query_valid: Tensor,
        scaling: Tensor,
        compact_keys: Tensor | None = None,
        query_weight: Tensor | None = None,
    ) -> Group:
        dt = torch.float64 if keys.dtype == torch.float64 or queries.dtype == torch.float64 else torch.float32
        beta0 = torch.where(torch.isfinite(log_mass), log_mass, torch.full_like(log_mass, -math.inf)).to(dt)
        operands = (keys, queries) if compact_keys is None else (keys, queries, compact_keys)
        if not exact_products.applies(*operands):
            keys, queries = keys.to(dt), queries.to(dt)
            compact_keys = None if compact_keys is None else compact_keys.to(dt)
        weight = None if query_weight is None else query_weight.to(dt)
        valid = query_valid.to(torch.bool)
        return cls(keys, values.to(dt), beta0, queries, valid, scaling.to(dt), compact_keys, weight)

    @property
    def dtype(self) -> torch.dtype:
        """The working precision: the values', β's and every statistic's (float32 or float64)."""
        return self.values.dtype

    @property
    def kept_keys(self) -> Tensor:
        """The keys the kept entries' features read: :attr:`compact_keys`, else :attr:`keys`."""
        return self.keys if self.compact_keys is None else self.compact_keys

    def selected_features(self, shift: Tensor, idx: Tensor, ok: Tensor) -> Tensor:
        """``Φ_S`` of the kept keys ``idx`` (see :func:`selected_features`)."""
        return selected_features(
            self.kept_keys, self.beta0, self.queries, self.query_valid, self.scaling, shift, idx, ok
        )
