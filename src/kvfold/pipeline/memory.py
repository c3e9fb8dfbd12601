"""Memory budgets: a fraction of the 16-bit full cache's bytes, spent on tokens × bits.

A memory budget ``m`` says the compressed cache may hold ``m`` times the bytes of the full cache
in 16 bits (the dtype a GPU user holds), whatever dtype the model computes in. The bytes an entry
holds depend on its storage (:meth:`kvfold.runtime.quant_config.QuantConfig.entry_bytes`: codes,
scales, zero points and β), so the same ``m`` keeps about three times the tokens at 4 bits as at
16. :func:`plan_memory` chooses the precision (unless the method's spec names one, ``@int4`` or
``@16``) by :data:`MEMORY_RULE` and the number of tokens that fits; the compression is then
checked against the bytes it really holds and redone smaller when it is over.

``full`` keeps every token, so under a memory budget it has bits alone to spend: it is stored in
the widest of :data:`FULL_FORMATS` that holds within the budget (:func:`full_formats`), and a
budget that even its narrowest cannot reach is refused (:func:`full_out_of_reach`) rather than
exceeded: 3 bits hold about a quarter of the 16-bit cache, so a budget of 1/20 needs a method that
keeps fewer tokens.

The rule was chosen on equal-bytes grids (docs/memory.md, "How a memory budget is split"):
*More Tokens, Lower Precision* (Zhang et al., EMNLP Findings 2025) finds the same shape: at equal
memory, more tokens at 4 bits beat fewer at 16, and 2 bits fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfold.methods.core.base import ComposedMethod, Standalone
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.quant_config import SIXTEEN_BIT, QuantConfig

SMALLEST_FOUR_BIT_MEMORY = 2**-5.5
"""Below this memory (about 1/45 of the 16-bit cache, halfway between 1/32 and 1/64 on a log axis)
the rule stores 3 bits: a quarter more tokens than 4 bits in the same bytes."""

MEMORY_RULE: tuple[tuple[float, str | None], ...] = (
    (1.0, None),
    (0.5625, "int8"),
    (SMALLEST_FOUR_BIT_MEMORY, "int4"),
    (0.0, "int3"),
)
"""``(lowest memory, format)`` in decreasing order: the first row whose memory is at most the budget
gives the format (:meth:`QuantConfig.parse`'s text; None: the model's dtype, no quantization). Chosen
on equal-bytes grids of ``kvzip+am_fit`` on seed 1's contexts of the headline suite (docs/memory.md):
from 0.5625 on every token fits in 8 bits; below it 4 bits retained the most or tied at 1/16 (2K: 8,
4, 3 and 2 bits); at 1/32 4 bits retained more at 2K (90 against 60 for 3 bits) and 3 bits a little
more at 4K (81.5 against 77.8); at 1/64 3 bits retained more at 4K (44.4 against 22.2) and tied at
2K (both with ``am_fit``'s bound on β at 4; with the default of 8, 3 bits kept 16 points more than
4 within 1/64 at 2K and tied at 4K, and the two tied within 1/32 at 2K). Below 1/64 nothing was measured.
Searched ranges with rounding by feedback (``clip=1`` with
``am_fit[value_feedback=true]``) retained more prose at 2K on two seeds and 10.6 points less at 4K
(8 contexts a task), rounding by feedback alone, rotated values (``rotate=1``) and layers of few
entries in 16 bits (``wide=16``) nothing measurably more at 2K (``wide=16``: 30 points less prose at
4K); they are options, not the rule (docs/memory.md)."""

ROW_LENGTH_BYTES = 8
"""Bytes a quantized row holds besides its entries: its length (int64)."""

MAX_RETRIES = 5
"""Compressions redone smaller when one holds more bytes than the budget (group rounding, uneven heads,
layers stored wider as their rows shorten)."""

SLOWEST_FALL = 0.25
"""The least elasticity :func:`shrink` assumes (bytes fall as tokens to this power): the step it takes
after a compression whose bytes fell less, or rose (``wide`` layers: fewer tokens turn more layers
into the wider storage)."""

FULL_FORMATS: tuple[str | None, ...] = (None, "int8", "int4", "int3")
"""The storages ``full`` (every token) may be given under a memory budget, widest first: the model's
dtype, then the rule's formats down to its narrowest, 3 bits. Two bits are used only when the spec
names them (``full@int2``): *More Tokens, Lower Precision* finds that 2 bits fail."""


@dataclass(frozen=True)
class MemoryPlan:
    """How a memory budget is spent: a token budget and a storage format (None: unquantized)."""

    memory: float
    tokens: Budget
    quant: QuantConfig | None


def rule_format(memory: float) -> QuantConfig | None:
    """The storage :data:`MEMORY_RULE` gives a memory budget."""
    for lowest, name in MEMORY_RULE:
        if memory >= lowest:
            return None if name is None else QuantConfig.parse(name)
    return QuantConfig()


def stores_log_mass(method: ComposedMethod) -> bool:
    """Whether the method's entries carry β (a folder or a standalone merges or fits them)."""
    return method.folder is not None or isinstance(method.selector, Standalone)


def entry_share(quant: QuantConfig | None, head_dim: int, value_dim: int, log_mass: bool) -> float:
    """Bytes of one stored entry over one 16-bit full-cache token's (K + V at 2 bytes)."""
    full = (head_dim + value_dim) * SIXTEEN_BIT
    if quant is None:
        return (full + (4 if log_mass else 0)) / full
    return quant.entry_bytes(head_dim, value_dim, log_mass) / full


def split_memory(
    memory: float, method: ComposedMethod, head_dim: int, value_dim: int
) -> tuple[float, QuantConfig | None]:
    """``(fraction of the tokens, storage)`` for ``memory`` by the closed form alone (no group
    rounding): what a conversation (``kvfold chat --memory``) keeps of its document."""
    quant = method.quant if method.precision_fixed else rule_format(memory)
    return min(1.0, memory / entry_share(quant, head_dim, value_dim, stores_log_mass(method))), quant


def cache_dims(cache: FoldedCache) -> tuple[int, int]:
    """``(head_dim, value_dim)`` of the cache's compressible layers.

    Raises:
        UserError: a cache with no compressible (full-attention) layer.
    """
    layers = [layer for _, layer in cache.folded_layers if layer.is_initialized]
    if not layers:
        raise UserError("a memory budget needs a prefilled cache with full-attention layers")
    return layers[0].head_dim, layers[0].padded()[1].shape[-1]


def full_share(quant: QuantConfig | None, head_dim: int, value_dim: int) -> float:
    """The memory (a fraction of the 16-bit cache) ``full`` holds in storage ``quant``, by the closed
    form: every entry, no β (row lengths and the rounding of the last key group apart)."""
    return entry_share(quant, head_dim, value_dim, log_mass=False)


def full_formats(memory: float, method: ComposedMethod, head_dim: int, value_dim: int) -> list[QuantConfig | None]:
    """The storages, widest first, in which ``full`` (every token) may fit ``memory`` by the closed
    form: of :data:`FULL_FORMATS`, or only the one the spec names (``full@int4``, ``--kv-bits``).
    Empty when none can; the compression still checks the bytes it holds (:func:`over_budget`)."""
    named = [method.quant] if method.precision_fixed else [QuantConfig.parse(f) for f in FULL_FORMATS]
    return [quant for quant in named if full_share(quant, head_dim, value_dim) <= memory * (1 + 1e-9)]


def full_out_of_reach(
    memory: float, method: ComposedMethod, head_dim: int, value_dim: int, held: float | None = None
) -> UserError:
    """The one-line refusal of a memory budget that ``full`` cannot reach by quantizing alone: what it
    can reach, and that a method which keeps fewer tokens is needed.

    Args:
        held: the memory the narrowest storage really held, when it was compressed and measured.
    """
    if method.precision_fixed:
        storage = "16 bits" if method.quant is None else method.quant.describe()
        share = full_share(method.quant, head_dim, value_dim) if held is None else held
        reach = f"{method.spec} keeps every token in {storage}: {share:.3g} of the 16-bit cache"
    else:
        narrowest = QuantConfig.parse(FULL_FORMATS[-1])
        share = full_share(narrowest, head_dim, value_dim) if held is None else held
        two = full_share(QuantConfig(format="int2"), head_dim, value_dim)
        reach = (
            f"'full' keeps every token and can only quantize them: in {narrowest.bits} bits they hold {share:.3g} "
            f"of the 16-bit cache (full@int2: {two:.3g})"
        )
    least = math.ceil(share * 1.01 * 1000) / 1000  # room for the row lengths and the last key groups
    return UserError(
        f"{reach}, so memory {memory:g} is out of its reach; give a memory of at least {least:g}, or a method "
        "that keeps fewer tokens (e.g. --method kvzip+am_fit)"
    )


def plan_memory(memory: float, method: ComposedMethod, cache: FoldedCache, context_tokens: int) -> MemoryPlan:
    """The token budget and storage for ``memory`` (a fraction of the 16-bit full cache's bytes).

    The share of one entry's bytes (:func:`entry_share`) sets the tokens; each row's last key group
    is on average half full while its scales are whole, so half a group's key scales per row
    (``0.5 · 4·D`` bytes, half a 16-bit token) and the row's length are set aside first.

    Raises:
        UserError: a cache with no compressible layer.
    """
    head_dim, value_dim = cache_dims(cache)
    fraction, quant = split_memory(memory, method, head_dim, value_dim)
    if quant is not None:
        token = (head_dim + value_dim) * SIXTEEN_BIT  # a 16-bit token's bytes
        per_row = ROW_LENGTH_BYTES + (0 if quant.is_float else 0.5 * 2 * SIXTEEN_BIT * head_dim)
        fraction -= per_row / token / max(context_tokens, 1) / entry_share(quant, head_dim, value_dim, True)
    fraction = min(1.0, max(fraction, 1.0 / max(context_tokens, 1)))
    return MemoryPlan(memory, Budget(fraction=fraction), quant)


def shrink(
    plan: MemoryPlan, measured: float, context_tokens: int, previous: tuple[float, float] | None = None
) -> MemoryPlan:
    """A smaller token budget after a compression held ``measured`` > ``plan.memory``: scaled by
    their ratio, and at least one token a row fewer (a budget rounds up to whole tokens, so on a
    short context a scaled budget can keep the same count).

    Bytes need not fall in proportion to the tokens: a row's last key group and its length stay, and
    with ``wide`` a layer whose rows shorten to one key group is stored wider, so fewer tokens can hold
    more bytes. Given the attempt before (``previous``: its token fraction and the memory it held),
    the step assumes the elasticity those two attempts show (``log`` bytes over ``log`` tokens),
    bounded by :data:`SLOWEST_FALL` and 1: the ratio raised to its inverse.
    """
    elasticity = 1.0
    if previous is not None:
        fraction_before, held_before = previous
        if fraction_before > plan.tokens.fraction and held_before > 0:
            fell = math.log(held_before / measured) / math.log(fraction_before / plan.tokens.fraction)
            elasticity = min(1.0, max(SLOWEST_FALL, fell))
    fraction = plan.tokens.fraction * (plan.memory / measured) ** (1 / elasticity) * 0.99
    fraction = min(fraction, (plan.tokens.count(context_tokens) - 1) / max(context_tokens, 1))
    return MemoryPlan(plan.memory, Budget(fraction=max(fraction, 1e-6)), plan.quant)


def over_budget(cache: FoldedCache, memory: float) -> float | None:
    """The cache's memory ratio when it exceeds ``memory`` (None when within it)."""
    ratio = cache.memory_ratio()
    return ratio if ratio > memory * (1 + 1e-9) and not math.isclose(memory, 1.0) else None
