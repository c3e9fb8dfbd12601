"""Each key's largest shifted logit over a block of queries: the product behind KVzip's scores, in one Triton
kernel on a GPU.

KVzip scores each context entry by the largest attention probability it receives from the repeat pass's
queries (Kim et al. 2025 §3.2): ``max_q exp(s·q·k − lse_q)``, from each query's log-sum-exp over the whole
cache (:func:`kvfold.methods.core.repeat.max_received`). Before the exponential that is
:func:`max_shifted_logits`: ``max_q (s·q·k + shift_q)`` with ``shift_q = −lse_q``, over every query row of a
KV head (its GQA group's heads × the forward's tokens) or over each query head's rows apart (KVzip+).

The PyTorch path (:func:`blocked_max_logits`) forms the logits in float32, a block of rows at a time, and
reduces them. At 32K tokens of Llama-3.1-8B's shape (32 layers, 32 query heads, head dimension 128), with
every entry scored by every repeat query (``kvzip[scope=all]``, and any cache that is not a fresh prefill,
as a chat's or a streamed prefill's re-compaction), that is about 280 TFLOP of float32 products, which an
H200 runs without tensor cores (about 67 TFLOP/s at best), and about 4.4 TB of float32 logits written and
read back: several seconds, against a 1.56 s prefill. With each chunk's entries scored by its own queries
(the default from 4K tokens on a fresh prefill) it is a sixteenth of that, about 18 TFLOP and 0.55 TB,
still about 0.3 of a prefill by arithmetic. :func:`fused_max_logits` reads the 16-bit rows and keys where they lie,
multiplies them on tensor cores with float32 sums, and keeps only each key's running maximum
(``max_logit_kernel`` in :mod:`kvfold.runtime.triton_kernels`): the same products at a 16-bit rate, and no
logit written. A product of two 16-bit numbers is exact in float32, so the two paths differ by the order
of the sums.

:func:`max_shifted_logits` takes the kernel where :func:`fused_applies` says so: CUDA, Triton installed,
16-bit rows and keys of one dtype, head dimension 16–256, and the kernel checked once a device and dtype
against the PyTorch path on a small problem (:data:`FUSED_STATUS`; ``kvfold bench`` records
:func:`scores_path`). Elsewhere (the CPU, float32 or float64 models) the PyTorch path runs as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvfold.runtime.device_checks import checked_once, error_line, status_key
from kvfold.runtime.triton_attention import MIN_BLOCK, available, block_size, interpreted

FUSED_DTYPES = (torch.float16, torch.bfloat16)
"""Rows and keys the kernel multiplies as they are (16 bits; float32 sums)."""

BLOCK_KEYS = 128
"""Keys a program holds while the rows go by: 256 programs a KV head at 32K entries."""

BLOCK_ROWS = 64
"""Query rows a step of the loop: compiled for an H200 with 8 warps, 128 keys and head dimension 128, a warp
group's matrix product (``wgmma``), 80 registers a thread, nothing spilled, 48 KB of shared memory
(Triton 3.9 and 3.6; ``tools/triton_targets.py``). Blocks of 256 keys spill."""

LAUNCH = {"num_warps": 8, "num_stages": 1}
"""The kernel's launch options (pipeline stages changed neither registers nor shared memory when compiled)."""

FUSED_FORCED: bool | None = None
"""None: :func:`max_shifted_logits` takes the kernel where :func:`fused_applies` says; True or False: the
kernel, or the PyTorch path, whatever it says (``benchmarks/key_scores.py`` times both in one process)."""

FUSED_STATUS: dict[str, str] = {}
"""Per device and dtype (``"cuda:0 torch.bfloat16"``), what :func:`fused_applies`'s check found: ``"fused"``,
or why not."""


def max_shifted_logits(query: Tensor, keys: Tensor, shift: Tensor, scaling: float, groups: int, block: int) -> Tensor:
    """``max_r (s·q_r·k + shift_r)`` for each key, over each group of a KV head's query rows.

    Args:
        query: ``(H, R, D)`` each KV head's ``R`` query rows, ``groups`` groups of ``R / groups`` consecutive
            rows (KVzip: one group; KVzip+: one a query head).
        keys: ``(H, N, D)`` the keys scored (a view with unit stride along ``D`` is read in place).
        shift: ``(H, R)`` added to each row's logits (``−lse``; ``−inf`` leaves a row out).
        scaling: the logit scale ``s``.
        groups: groups of rows, each reduced apart.
        block: rows a block on the PyTorch path (:func:`blocked_max_logits`).

    Returns:
        ``(H, groups, N)`` in ``shift``'s dtype (float32; float64 for float64 queries on the PyTorch path).
    """
    if fused_applies(query, keys) if FUSED_FORCED is None else FUSED_FORCED:
        return fused_max_logits(query, keys, shift, scaling, groups)
    return blocked_max_logits(query, keys, shift, scaling, groups, block)


def blocked_max_logits(query: Tensor, keys: Tensor, shift: Tensor, scaling: float, groups: int, block: int) -> Tensor:
    """:func:`max_shifted_logits` by PyTorch: one ``baddbmm`` a block of ``block`` rows, in ``shift``'s dtype
    (blocks never straddle two groups)."""
    acc = shift.dtype
    rows = query.shape[1]
    per_group = rows // groups
    folded = query.to(acc)
    key_t = keys.to(acc).transpose(-1, -2)
    column = shift[:, :, None]
    best = torch.full((query.shape[0], groups, keys.shape[1]), float("-inf"), dtype=acc, device=query.device)
    for g in range(groups):
        for lo in range(g * per_group, (g + 1) * per_group, block):
            hi = min(lo + block, (g + 1) * per_group)
            logits = torch.baddbmm(column[:, lo:hi], folded[:, lo:hi], key_t, alpha=scaling)  # s·q·k + shift
            best[:, g] = torch.maximum(best[:, g], logits.amax(dim=1))
            del logits  # before the next block's: one block held, not two
    return best


def fused_max_logits(query: Tensor, keys: Tensor, shift: Tensor, scaling: float, groups: int) -> Tensor:
    """:func:`max_shifted_logits` by the Triton kernel: one program a KV head, block of :data:`BLOCK_KEYS` keys
    and group of rows; float32. Runs on CUDA, or on the CPU under Triton's interpreter (tests)."""
    if query.device.type != "cuda" and not interpreted():
        raise ValueError("fused_max_logits() runs on CUDA, or with TRITON_INTERPRET=1 set before Triton is imported")
    if query.dtype not in FUSED_DTYPES or keys.dtype != query.dtype:
        raise ValueError(f"fused_max_logits(): 16-bit rows and keys of one dtype, not {query.dtype} and {keys.dtype}")
    heads, rows, d = query.shape
    n = keys.shape[1]
    if rows % groups:
        raise ValueError(f"fused_max_logits(): {rows} rows do not make {groups} equal groups")
    from kvfold.runtime.triton_kernels import max_logit_kernel  # imports Triton, here only

    query = query.contiguous()
    if keys.stride(2) != 1:
        keys = keys.contiguous()
    shift = shift.to(torch.float32).contiguous()
    out = torch.empty(heads, groups, n, dtype=torch.float32, device=query.device)
    if not n or not rows:
        return out.fill_(float("-inf"))
    upcast = interpreted() and query.dtype == torch.bfloat16  # the interpreter's bfloat16 products are wrong
    max_logit_kernel[(heads, -(-n // BLOCK_KEYS), groups)](
        query, keys, shift, out,
        rows, n, d, groups, keys.stride(0), keys.stride(1), float(scaling),
        BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_KEYS, BLOCK_D=block_size(d), UPCAST=upcast, **LAUNCH,
    )  # fmt: skip
    return out


def fused_applies(query: Tensor, keys: Tensor) -> bool:
    """Whether :func:`max_shifted_logits` takes the kernel: CUDA, Triton installed, 16-bit rows and keys of one
    dtype, head dimension 16–256, and the kernel found right on this device and dtype (checked once,
    :data:`FUSED_STATUS`)."""
    if query.device.type != "cuda" or not available():
        return False
    if query.dtype not in FUSED_DTYPES or keys.dtype != query.dtype or not MIN_BLOCK <= query.shape[-1] <= 256:
        return False
    found = checked_once(
        FUSED_STATUS, query.device, query.dtype, lambda: check_fused(query.device, query.dtype, query.shape[-1])
    )
    return found == "fused"


def check_fused(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> str:
    """``"fused"`` when :func:`fused_max_logits` gives :func:`blocked_max_logits`'s maxima on a small problem
    (3 KV heads of 2 groups of 70 rows, 300 keys read from a wider cache, ``head_dim``; one row left out),
    else ``"float32 products (why)"``. At the calls' own head dimension the check compiles the kernel they
    run (the kernel's sizes are not specialised, and the keys' strides and offsets are multiples of 16
    elements as a cache's are), so a process compiles it once, or loads it from Triton's cache on disk."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 140, head_dim, generator=gen).to(device=device, dtype=dtype)
    keys = torch.randn(3, 320, head_dim, generator=gen).to(device=device, dtype=dtype)[:, 16:316]
    shift = -torch.rand(3, 140, generator=gen).to(device) * 4
    shift[1, 5] = float("-inf")
    try:
        got = fused_max_logits(query, keys, shift, 0.125, 2)
    except Exception as err:  # noqa: BLE001 - a compiler's or a driver's error, whatever its class
        return f"float32 products (the kernel failed: {type(err).__name__}: {error_line(err)})"
    want = blocked_max_logits(query, keys, shift, 0.125, 2, 32)
    off = float((got - want).abs().max())
    if not off <= 1e-3:  # the sums' order moves these logits (|s·q·k| ≤ 10) by about 1e-6
        return f"float32 products (the kernel is off by {off:.3g})"
    return "fused"


def scores_path(device: torch.device, dtype: torch.dtype) -> str:
    """How KVzip's scores are formed for queries of ``dtype`` on ``device``: ``"fused (Triton)"``, or
    ``"float32 products (why)"`` (:func:`blocked_max_logits`)."""
    if device.type != "cuda":
        return f"float32 products (on {device.type})"
    if not available():
        return "float32 products (Triton is not installed)"
    if dtype not in FUSED_DTYPES:
        return f"float32 products ({dtype}: the kernel takes 16-bit queries)"
    status = FUSED_STATUS.get(status_key(device, dtype), "float32 products (not checked on this device yet)")
    return "fused (Triton)" if status == "fused" else status
