"""A fixed rotation of a head's values before they are coded: a randomized Hadamard transform.

Values are coded one scale an entry over their channels (:mod:`kvfold.runtime.quantize`), so an entry
whose channels differ widely in size (a few large, many small) spends its few levels on the large
ones. Rotating every value by the same orthogonal matrix ``T = diag(s) · H / √D`` (``H`` the Sylvester
Hadamard matrix, ``s`` a fixed pattern of signs) spreads each entry's size evenly over its channels
before the codes, as QuaRot does for the values of its 4-bit KV caches (Ashkboos et al. 2024, *QuaRot:
Outlier-Free 4-Bit Inference in Rotated LLMs*). Attention is linear in the values, so the stored
part's weighted values are rotated back with ``Tᵀ`` once per layer and step (a ``D × D`` product); the
codes are read as they lie. Nothing is stored for ``T``: it follows from ``D`` alone.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

SIGN_SEED = 0x6B76
"""Seed of the fixed sign pattern (a linear congruential sequence, the same on every machine)."""

_ROTATIONS: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def rotation_signs(dim: int) -> list[float]:
    """The ``dim`` signs of ``T``'s diagonal factor: bit 16 of a linear congruential sequence (the C
    library's constants), so the rotation never depends on a random number generator's version."""
    state, signs = SIGN_SEED, []
    for _ in range(dim):
        state = (1103515245 * state + 12345) % (1 << 31)
        signs.append(1.0 if (state >> 16) & 1 else -1.0)
    return signs


def value_rotation(dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``T`` ``(dim, dim)``, orthogonal (``T Tᵀ = I``): row ``i`` of the Sylvester Hadamard matrix times
    sign ``i``, over ``√dim``; kept per device and dtype.

    Raises:
        ValueError: ``dim`` is not a power of two (no Sylvester Hadamard matrix).
    """
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a rotated value storage needs a value dimension that is a power of two; got {dim}")
    key = (dim, torch.device(device), dtype)
    if key not in _ROTATIONS:
        hadamard = torch.ones(1, 1, dtype=torch.float64)
        while hadamard.shape[0] < dim:
            hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
        signs = torch.tensor(rotation_signs(dim), dtype=torch.float64)[:, None]
        _ROTATIONS[key] = (signs * hadamard / dim**0.5).to(device=device, dtype=dtype)
    return _ROTATIONS[key]


def rotate(values: Tensor) -> Tensor:
    """``values · T`` over the last dimension, in float32 or wider (``values``' own if wider)."""
    acc = torch.promote_types(values.dtype, torch.float32)
    return values.to(acc) @ value_rotation(values.shape[-1], values.device, acc)


def rotate_back(values: Tensor) -> Tensor:
    """``values · Tᵀ``: what :func:`rotate` rotated, as it was (in ``values``' dtype, float32 or wider)."""
    acc = torch.promote_types(values.dtype, torch.float32)
    return values.to(acc) @ value_rotation(values.shape[-1], values.device, acc).T
