"""Fitted values rounded to their storage grid with error feedback, so the fit absorbs the values' codes.

Attention Matching (Zweiger et al. 2026, §3.2, eq. 3–4) fits the kept entries' values ``C_v`` by
least squares, ``min ‖X C_v − Y‖`` with ``X`` the compacted attention weights on the reference
queries. A quantized cache then rounds every fitted value to its entry's grid (per-entry min–max,
:mod:`kvfold.runtime.quantize`), and the output moves by ``X (Q(C_v) − C_v)``: a loss the fit never
saw. Rounding the entries one at a time and moving the error of each onto the entries not rounded
yet, in the directions ``X`` cannot tell apart, is GPTQ's update (Frantar et al. 2023, *GPTQ:
Accurate Post-Training Quantization for Generative Pre-trained Transformers*, §3, Algorithm 1, with
one entry a block): with ``H = XᵀX`` (damped) and ``U`` the upper Cholesky factor of ``H⁻¹``, entry
``j`` is rounded, ``e = (c_j − Q(c_j)) / U_jj`` and ``c_k −= U_jk e`` for every later ``k``. It
minimises ``‖X (Ĉ_v − C_v)‖`` greedily, where plain rounding ignores ``X``. Entries are taken in
decreasing ``H_jj`` (the attention they receive: GPTQ's "act-order" heuristic), so the entries the
queries read most are rounded first and the others absorb their error.

Not in Attention Matching (which does not quantize) nor in GPTQ (which rounds weights, not a cache):
the pairing is kvfold's. The rounded values lie on the grid their own min–max gives, so storing them
(:meth:`kvfold.runtime.quantize.QuantizedRows.from_padded`) gives back the same codes.
"""

from __future__ import annotations

import torch

from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quant_grid import dequantize_minmax, group_params, quantize_minmax
from kvfold.runtime.value_rotation import rotate, rotate_back

Tensor = torch.Tensor

DAMP = 0.01
"""GPTQ's dampening: ``λ = 0.01 · mean diag(H)`` added to ``H`` before it is inverted (Frantar et al. 2023, §4)."""


def round_entries(values: Tensor, storage: QuantConfig) -> Tensor:
    """``values`` ``(..., D)`` rounded to their entries' grids in integer ``storage`` (per-entry groups
    of ``value_group`` channels, min–max or searched ranges), as that storage gives them back."""
    dim = values.shape[-1]
    size = storage.value_group or dim
    x = (rotate(values) if storage.rotate else values.float()).reshape(*values.shape[:-1], dim // size, size)
    scale, zero = group_params(x, x.amin(-1), x.amax(-1), storage.bits, -1, bool(storage.clip))
    codes = quantize_minmax(x, scale[..., None], zero[..., None], storage.bits)
    out = dequantize_minmax(codes, scale[..., None], zero[..., None], torch.float32).reshape(values.shape)
    return (rotate_back(out) if storage.rotate else out).to(values.dtype)


def _inverse_factor(gram: Tensor, ok: Tensor, damp: float) -> Tensor:
    """``U`` ``(P, t, t)``, the upper Cholesky factor of ``(H + λI)⁻¹`` (unused slots: identity rows),
    the damping raised tenfold (three times at most) where a factorisation fails."""
    okf = ok.to(gram.dtype)
    h = gram * okf[..., :, None] * okf[..., None, :] + torch.diag_embed(1.0 - okf)
    diag = h.diagonal(dim1=-2, dim2=-1)
    count = ok.sum(-1).clamp_min(1)
    mean = (diag * okf).sum(-1) / count
    mean = torch.where(mean > 0, mean, torch.ones_like(mean))
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    out = eye.expand_as(h).clone()
    todo = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    for factor in (1.0, 10.0, 100.0, 1000.0):
        if not bool(todo.any()):
            break
        damped = h[todo] + (factor * damp * mean[todo])[:, None, None] * eye
        chol, info = torch.linalg.cholesky_ex(damped)
        inverse = torch.cholesky_inverse(chol)
        upper, info2 = torch.linalg.cholesky_ex(inverse, upper=True)
        good = (info == 0) & (info2 == 0) & torch.isfinite(upper).flatten(1).all(-1)
        rows = todo.nonzero(as_tuple=True)[0]
        out[rows[good]] = upper[good]
        todo[rows[good]] = False
    return out


def feedback_round(values: Tensor, gram: Tensor, ok: Tensor, storage: QuantConfig, damp: float = DAMP) -> Tensor:
    """The fitted values ``(P, t, D)`` rounded to their storage grid with GPTQ's error feedback.

    Args:
        values: fitted values ``C_v``.
        gram: ``(P, t, t)`` ``H = XᵀX`` of the compacted attention weights on the reference queries.
        ok: ``(P, t)`` bool, the used slots (the others are returned rounded, with no feedback).
        storage: the integer format the values will be stored in.
        damp: GPTQ's relative dampening of ``H``.

    Returns:
        ``(P, t, D)`` values on their own min–max grid (what storage gives back), chosen so that
        ``‖X (out − values)‖`` is small rather than each ``|out − values|``.
    """
    P, t, _ = values.shape
    if t == 0:
        return values.clone()
    work = values.double() if values.dtype == torch.float64 else values.float()
    h = gram.to(work.dtype)
    diag = h.diagonal(dim1=-2, dim2=-1).masked_fill(~ok, float("-inf"))
    order = diag.argsort(dim=-1, descending=True, stable=True)  # act-order; unused slots last
    h = h.gather(1, order[..., None].expand(-1, -1, t)).gather(2, order[:, None, :].expand(-1, t, -1))
    used = ok.gather(1, order)
    c = work.gather(1, order[..., None].expand_as(work)).clone()
    upper = _inverse_factor(h, used, damp)
    for j in range(t):
        rounded = round_entries(c[:, j], storage)
        error = (c[:, j] - rounded) / upper[:, j, j, None]
        error = error * used[:, j, None].to(error.dtype)
        c[:, j] = rounded
        if j + 1 < t:
            c[:, j + 1 :] -= upper[:, j, j + 1 :, None] * error[:, None, :]
    out = torch.empty_like(c)
    out.scatter_(1, order[..., None].expand_as(c), c)
    return out.to(values.dtype)
