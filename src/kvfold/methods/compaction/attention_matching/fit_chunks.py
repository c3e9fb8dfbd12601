"""Fits that grow linearly with the context: each repeat chunk's entries fitted on its own queries.

Zweiger et al. 2026 (``papers/attention-matching.md``) compact long contexts in contiguous chunks
(§3.5, App. C.3): each chunk ``i`` is one block ``(C_k, β, C_v)`` fitted to match, on reference
queries, the attention mass and output of *that chunk's* entries (§2: compacting a span matches
the span's contribution), and the compacted chunks are concatenated. A fit on every reference query
costs ``n·t²`` per head with ``n`` (queries) and ``t`` (kept entries) both proportional to the
context, cubic in its length; fitted chunk by chunk on the chunk's own queries it costs
``Σ_i n_i·t_i²``, linear.

kvfold's chunks are the repeat pass's (:mod:`kvfold.methods.core.repeat`, KVzip's 2,048-token
chunks): chunk ``i`` holds the context entries whose positions fall in the span that repeat chunk
``i`` repeats (the template before the text counts in chunk 0), and its reference queries are the
repeat-prefill queries recorded while that chunk was repeated; queries of other sources
(self-study, context, random) read the whole context and are shared by every chunk. The
departures from the paper: its KV-based chunking takes 4,096-token chunks and draws each chunk's
queries from a pass over ⟨prefix⟩⟨chunk i⟩⟨suffix⟩ (the other chunks' entries removed); kvfold
reuses the one repeat pass over the whole cache, so a chunk's queries also saw the other chunks
(their attention to them is not part of the chunk's target: each block's target is its own mass
and output, §2).

The option ``fit_chunk`` (``am_fit`` and the ``am_*`` variants) chooses: ``auto`` (default) fits
contexts under :data:`AUTO_FROM` tokens in one piece — exactly the unchunked fit — and longer ones
by repeat chunk when the reference queries include the repeat pass; ``none`` never chunks; ``N``
fits chunks of ``N`` context tokens on a repeat pass in ``N``-token chunks (a pass of its own
unless ``N`` is KVzip's 2,048). Chunking needs each cache slot's position: a cache already
compressed (chunked prefill, a conversation) is fitted in one piece.
"""

from __future__ import annotations

import math

import torch

from kvfold.methods.compaction.attention_matching.queries import ReferenceQueries, group_by_chunk
from kvfold.methods.compaction.attention_matching.solve import Compacted, FitConfig, fit_problems
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.repeat import REPEAT_CHUNK, token_chunks
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.attention import FLASH_WITH_LSE
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

AUTO_FROM = 4096
"""``fit_chunk=auto`` fits contexts of at least this many tokens chunk by chunk (fewer: one piece)."""


def parse_fit_chunk(text: str, owner: str) -> int | str | None:
    """``auto`` → ``"auto"``, ``none`` → None, a positive integer → itself; else a ``SpecError``."""
    value = text.strip().lower()
    if value in ("auto", "none"):
        return None if value == "none" else "auto"
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise SpecError(f"{owner}: fit_chunk must be auto, none or a number of tokens ≥ 1; got {text!r}")
    return number


def fit_chunk_tokens(text: str, owner: str, ctx: CompressionContext, sources: tuple[str, ...]) -> int:
    """Context tokens per fit chunk for this context (see the module docstring); 0 = one piece."""
    value = parse_fit_chunk(text, owner)
    if value is None:
        return 0
    if value == "auto":
        long = int(ctx.context_lengths.max()) >= AUTO_FROM if ctx.context_lengths.numel() else False
        return REPEAT_CHUNK if long and "repeat" in sources else 0
    return int(value)


def layer_chunks(ctx: CompressionContext, layer: FoldedLayer, tokens: int) -> Tensor | None:
    """``(B, N)`` the repeat chunk of every slot of a freshly prefilled layer (−1 on left padding),
    or None when the layer's slots are not the context's positions (a compressed cache)."""
    if not ctx.slots_are_tokens(layer):
        return None
    key = ("fit_chunks", tokens)
    if key not in ctx.memo:
        ctx.memo[key] = token_chunks(ctx, tokens)
    return ctx.memo[key].to(layer.device)


def _gather_blocks(keys: Tensor, values: Tensor, log_mass: Tensor, chunk_of: Tensor, chunks: int):
    """Each chunk's slots ``(B, H, C, W)`` (ascending, unused last), their keys, values and β⁰
    (−inf on unused slots), and every slot's position in its block ``(B, H, N)``."""
    batch, heads, length, dim = keys.shape
    ids = chunk_of[:, None, :].expand(batch, heads, length)
    slot, in_block = group_by_chunk(ids, torch.ones_like(ids, dtype=torch.bool), chunks)
    width = slot.shape[-1]
    flat = slot.flatten(2)
    k = keys.gather(2, flat[..., None].expand(-1, -1, -1, dim)).reshape(batch, heads, chunks, width, dim)
    v = values.gather(2, flat[..., None].expand(-1, -1, -1, values.shape[-1]))
    v = v.reshape(batch, heads, chunks, width, values.shape[-1])
    lm = log_mass.gather(2, flat).reshape(slot.shape).masked_fill(~in_block, -math.inf)
    dest = torch.where(in_block, slot, torch.full_like(slot, length)).flatten(2)
    local = torch.arange(width, device=keys.device).expand(slot.shape).flatten(2)
    where = torch.full((batch, heads, length + 1), -1, dtype=torch.long, device=keys.device)
    where.scatter_(2, dest, local)
    return slot, k, v, lm, where[..., :length]


def fit_given_by_chunk(
    keys: Tensor,
    values: Tensor,
    log_mass: Tensor,
    queries: ReferenceQueries,
    chunk_of: Tensor,
    given: Tensor,
    scaling: float,
    config: FitConfig,
    compact_keys: Tensor | None = None,
    by_share: bool = False,
    context_is_matched: bool = False,
) -> Compacted:
    """:func:`~.solve.fit_problems` with ``given`` kept positions (the ``am_fit`` folder), one block per
    repeat chunk: chunk ``c``'s kept entries are fitted to the mass and output of chunk ``c``'s
    entries on the queries recorded while chunk ``c`` was repeated.

    With ``by_share`` each query's residuals in chunk ``c``'s fit are weighted by chunk ``c``'s share
    of the query's attention (squared; :func:`chunk_shares`): the sum of the chunks' objectives is
    then the fit on every query (eq. 2 relative to the query's whole mass, eq. 1 on its whole
    output) less the products between chunks' residuals, where by default each chunk's residuals
    count relative to its own mass and output, as if the chunk were the whole cache. The shares
    cost each chunk's problem one attention over its block (:func:`share_weights`).

    Args:
        keys, values: ``(B, H, N, D)`` the layer; log_mass: ``(B, H, N)`` β⁰ of the entries the fit
            matches (−inf elsewhere, e.g. kept entries left verbatim).
        queries: the layer's reference queries with their repeat chunks.
        chunk_of: ``(B, N)`` the repeat chunk of every slot (:func:`layer_chunks`).
        given: ``(B, H, K)`` kept slots fitted (ascending, −1 = unused slot).
        scaling: the logit scale.
        config: the fit.
        compact_keys: optional ``(B, H, N, D)`` the keys as the kept entries will be stored
            (:func:`~.solve.fit_problems`).
        by_share: weight each query by the chunk's share of its attention (above).
        context_is_matched: the fit matches every context entry (nothing kept verbatim), so a
            repeat query's mass over the matched entries is its mass over the context, which the
            repeat pass recorded (:attr:`ReferenceQueries.context_lse`).

    Returns:
        A :class:`~.solve.Compacted` ``(B, H, K)`` laid out as :func:`~.solve.fit_problems` lays out
        a fit with ``given``: slot ``m`` is the ``m``-th used given slot (ascending); the residuals
        are the mean over the chunks that keep entries.
    """
    chunks = max(1, int(chunk_of.max()) + 1)
    batch, heads, length, _ = keys.shape
    slot, k, v, lm, where = _gather_blocks(keys, values, log_mass, chunk_of, chunks)
    used = given >= 0
    kept_slot = given.clamp_min(0)
    kept_chunk = chunk_of[:, None, :].expand(batch, heads, length).gather(2, kept_slot)
    pick, picked = group_by_chunk(kept_chunk, used, chunks)  # (B, H, C, K_c) along the given axis
    block_pos = where.gather(2, kept_slot.gather(2, pick.flatten(2))).view_as(pick)
    block_given = torch.where(picked, block_pos, torch.full_like(block_pos, -1))
    q, qv = queries.by_chunk(chunks)
    block_compact = None
    if compact_keys is not None:
        flat = slot.flatten(2)[..., None].expand(-1, -1, -1, compact_keys.shape[-1])
        block_compact = compact_keys.gather(2, flat).view_as(k)
    weight = None
    if by_share:
        weight = share_weights(k, lm, q, queries, scaling, context_is_matched).square()
    res = fit_problems(
        k, v, lm, q, qv, None, scaling, config, given=block_given, compact_keys=block_compact, query_weight=weight
    )
    return _concatenate_chunks(res, slot, given.shape[-1])


def share_weights(
    block_keys: Tensor,
    block_log_mass: Tensor,
    block_queries: Tensor,
    queries: ReferenceQueries,
    scaling: float,
    context_is_matched: bool,
) -> Tensor:
    """``(B, H, C, n_c)``: for each query of chunk ``c``'s problem (:meth:`ReferenceQueries.by_chunk`),
    chunk ``c``'s share of its attention mass over the matched entries (0 on unused places).

    The share's numerator is the query's log-sum-exp over chunk ``c``'s block (``Σ_c n_c·W_c``
    products: a query shared by every chunk reads every block once, a chunk's own query its own
    block). Its denominator, the mass over every matched entry: for a chunk's own queries the mass
    over the context the repeat pass recorded (:attr:`ReferenceQueries.context_lse`), when
    ``context_is_matched`` and it is known; for shared queries the sum of their blocks' masses;
    otherwise every query's mass on every block (:func:`chunk_shares`: ``n·N`` products, the logits
    of an attention over the context).

    Args:
        block_keys: ``(B, H, C, W, D)`` each chunk's keys; block_log_mass: ``(B, H, C, W)`` their β⁰
            (−inf: not matched, or no entry).
        block_queries: ``(B, H, C, n_c, D)`` each chunk's problem's queries.
        queries: the reference queries they were taken from.
        scaling: the logit scale.
        context_is_matched: every context entry is matched (see :func:`fit_given_by_chunk`).
    """
    chunks = block_keys.shape[2]
    index, index_ok = queries.chunk_index(chunks)
    chunk_at = queries.chunks_or_none().gather(2, index.flatten(2)).view_as(index)
    own = index_ok & (chunk_at >= 0)
    lse = queries.context_lse
    known = (
        lse is not None
        and context_is_matched
        and not bool(lse.gather(2, index.flatten(2)).view_as(index)[own].isnan().any())
    )
    if not known:
        shares = chunk_shares(block_keys, block_log_mass, queries.queries, scaling).transpose(2, 3)  # (B, H, C, n)
        return shares.gather(3, index) * index_ok
    mass = torch.stack(
        [
            _log_sum_exp(block_keys[:, :, c], block_log_mass[:, :, c], block_queries[:, :, c], scaling)
            for c in range(chunks)
        ],
        dim=2,
    )  # (B, H, C, n_c): each problem's query on its chunk's block
    shared = index_ok & (chunk_at < 0)  # the same queries at the same places of every chunk's problem
    shared_total = torch.logsumexp(mass.masked_fill(~shared, -math.inf), dim=2, keepdim=True)
    context = lse.gather(2, index.flatten(2)).view_as(index).to(mass.dtype)
    total = torch.where(shared, shared_total, context)
    share = (mass - total).exp_().nan_to_num_(0.0).clamp_(0.0, 1.0)  # no matched mass: 0
    return share * index_ok


SHARE_BLOCK_BYTES = 1 << 28
"""Memory for one block of logits while :func:`chunk_shares` runs without the fused kernel."""


def chunk_shares(block_keys: Tensor, block_log_mass: Tensor, queries: Tensor, scaling: float) -> Tensor:
    """``(B, H, n, C)``: the share of each query's attention mass over the entries the fit matches
    that falls on each chunk's entries, ``Σ_{j ∈ c} e^{s q·k_j + β⁰_j} / Σ_j e^{s q·k_j + β⁰_j}``
    (rows sum to 1; 0 where no entry is matched), from each chunk's log-sum-exp.

    Args:
        block_keys: ``(B, H, C, W, D)`` each chunk's keys; block_log_mass: ``(B, H, C, W)`` their β⁰
            (−inf: not matched, or no entry).
        queries: ``(B, H, n, D)`` the queries.
        scaling: the logit scale.

    Costs ``n·N`` products, the logits of one attention over the context: in the fused CPU kernel
    (float32, bfloat16) without the ``(n, N)`` logits in memory, else in blocks of
    :data:`SHARE_BLOCK_BYTES`."""
    chunks = block_keys.shape[2]
    lse = torch.stack(
        [_log_sum_exp(block_keys[:, :, c], block_log_mass[:, :, c], queries, scaling) for c in range(chunks)], -1
    )
    return torch.softmax(lse, dim=-1).nan_to_num_(0.0)  # a query that matches no entry: 0 everywhere


def _log_sum_exp(keys: Tensor, log_mass: Tensor, queries: Tensor, scaling: float) -> Tensor:
    """``(B, H, n)`` each query's ``log Σ_j e^{s q·k_j + β⁰_j}`` over ``keys`` ``(B, H, W, D)`` (−inf
    where every β⁰ is −inf), in float32 (float64 for float64 keys)."""
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    batch, heads, width, dim = keys.shape
    n = queries.shape[2]
    empty = ~torch.isfinite(log_mass).any(-1)[..., None]
    fused = FLASH_WITH_LSE is not None and keys.device.type == "cpu" and dt == torch.float32 and width > 0
    if fused:
        q, k = queries.to(dt), keys.to(dt)
        # the values are not read; stride 0 along the entries costs the kernel 3.5× (24K queries × 2K keys)
        zeros = k.new_zeros(1, 1, width, dim).expand(batch, heads, width, dim)
        bias = log_mass.to(dt)[:, :, None, :].expand(batch, heads, n, width)
        lse = FLASH_WITH_LSE(q, k, zeros, 0.0, False, attn_mask=bias, scale=float(scaling))[1]
        return lse.to(dt).masked_fill(empty, -math.inf)
    rows = max(1, SHARE_BLOCK_BYTES // max(1, batch * heads * width * torch.finfo(dt).bits // 8))
    k, lm = keys.to(dt), log_mass.to(dt)[:, :, None, :]
    parts = [
        torch.logsumexp((queries[:, :, lo : lo + rows].to(dt) @ k.mT).mul_(scaling).add_(lm), dim=-1)
        for lo in range(0, n, rows)
    ]
    return torch.cat(parts, dim=2) if parts else keys.new_zeros(batch, heads, 0, dtype=dt)


def _concatenate_chunks(res: Compacted, slot: Tensor, width: int) -> Compacted:
    """Chunk results ``(B, H, C, t)`` → ``(B, H, width)``: chunk after chunk, each chunk's entries in
    order (positions ascend: chunks are contiguous spans in position order)."""
    batch, heads, chunks, t = res.index.shape
    lens = res.lengths
    offsets = lens.cumsum(-1) - lens
    j = torch.arange(t, device=lens.device)
    in_use = j < lens[..., None]
    dest = torch.where(in_use, offsets[..., None] + j, torch.full_like(in_use, width, dtype=torch.long)).flatten(2)
    dim = res.values.shape[-1]
    index = torch.zeros(batch, heads, width + 1, dtype=torch.long, device=lens.device)
    log_mass = torch.full((batch, heads, width + 1), -math.inf, dtype=res.log_mass.dtype, device=lens.device)
    values = res.values.new_zeros(batch, heads, width + 1, dim)
    index.scatter_(2, dest, slot.gather(3, res.index.clamp_max(max(slot.shape[-1] - 1, 0))).flatten(2))
    log_mass.scatter_(2, dest, res.log_mass.flatten(2))
    values.scatter_(2, dest[..., None].expand(-1, -1, -1, dim), res.values.flatten(2, 3))
    fitted = (lens > 0).to(res.mass_error.dtype)
    count = fitted.sum(-1).clamp_min(1)
    return Compacted(
        index=index[..., :width],
        log_mass=log_mass[..., :width],
        values=values[:, :, :width],
        lengths=lens.sum(-1),
        mass_error=(res.mass_error * fitted).sum(-1) / count,
        output_error=(res.output_error * fitted).sum(-1) / count,
    )
