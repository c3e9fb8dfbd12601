"""kvfold's Triton kernels: the stored part of a decode's attention (:mod:`kvfold.runtime.triton_attention`) and
KVzip's scores (:mod:`kvfold.runtime.key_scores`). Imported only where they run: this module imports Triton, and
Triton's interpreter, ``TRITON_INTERPRET=1``, is chosen when a kernel is defined."""

import triton
import triton.language as tl


@triton.jit
def unpack(codes_ptr, entries, channels, valid, n_bytes, width, BITS: tl.constexpr):
    """The codes of ``channels`` ``(C,)`` of ``entries`` ``(S,)``: ``(S, C)`` float32."""
    base = codes_ptr + entries[:, None] * n_bytes
    if BITS == 8:
        return tl.load(base + channels[None, :], mask=valid, other=0).to(tl.float32)
    elif BITS == 3:  # eight codes in three bytes, code i at bit 3i (little-endian)
        bit = (channels % 8) * 3
        byte = (channels // 8) * 3 + bit // 8
        low = tl.load(base + byte[None, :], mask=valid, other=0).to(tl.int32)
        spill = valid & ((byte + 1) < n_bytes)[None, :]
        high = tl.load(base + byte[None, :] + 1, mask=spill, other=0).to(tl.int32)
        return (((low | (high << 8)) >> (bit % 8)[None, :]) & 7).to(tl.float32)
    else:  # 4 and 2 bits by planes: channel c in byte c % width, plane c // width
        plane = channels // width
        byte = tl.load(base + (channels % width)[None, :], mask=valid, other=0).to(tl.int32)
        return ((byte >> (plane * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def stored_part_kernel(
    q_ptr, split_row_ptr, split_start_ptr, split_end_ptr, slots_ptr, bias_ptr,
    keys_ptr, values_ptr, key_scale_ptr, key_zero_ptr, value_scale_ptr, value_zero_ptr,
    top_ptr, den_ptr, num_ptr,
    m, d, dv, key_bytes, value_bytes, scaling,
    BITS: tl.constexpr, SIZE: tl.constexpr, PART: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One split of a row's pages (``kvfold.runtime.pages.PageSplits``) against the row's queries: the split's
    maximum logit, and relative to it its weights' sum and weighted values, at the split's place."""
    split = tl.program_id(0)
    row = tl.load(split_row_ptr + split)
    queries = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = queries < m
    channels = tl.arange(0, BLOCK_D)
    value_channels = tl.arange(0, BLOCK_DV)
    d_valid = channels < d
    dv_valid = value_channels < dv
    q = tl.load(
        q_ptr + (row * m + queries)[:, None] * d + channels[None, :],
        mask=q_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    start = tl.load(split_start_ptr + split)
    end = tl.load(split_end_ptr + split)
    for part in range(start * (SIZE // PART), end * (SIZE // PART)):  # a page in parts of PART entries
        page = part // (SIZE // PART)
        position = (part % (SIZE // PART)) * PART + tl.arange(0, PART)
        entries = tl.load(slots_ptr + page * SIZE + position)
        bias = tl.load(bias_ptr + page * SIZE + position)
        if BITS == 16:  # rows at full precision
            keys = tl.load(keys_ptr + entries[:, None] * d + channels[None, :], mask=d_valid[None, :], other=0.0).to(
                tl.float32
            )
            values = tl.load(
                values_ptr + entries[:, None] * dv + value_channels[None, :], mask=dv_valid[None, :], other=0.0
            ).to(tl.float32)
        else:  # one key scale and zero point a page (its key group)
            key_codes = unpack(keys_ptr, entries, channels, d_valid[None, :], key_bytes, d * BITS // 8, BITS)
            scale = tl.load(key_scale_ptr + page * d + channels, mask=d_valid, other=0.0).to(tl.float32)
            zero = tl.load(key_zero_ptr + page * d + channels, mask=d_valid, other=0.0).to(tl.float32)
            keys = key_codes * scale[None, :] + zero[None, :]
            value_codes = unpack(
                values_ptr, entries, value_channels, dv_valid[None, :], value_bytes, dv * BITS // 8, BITS
            )
            value_scale = tl.load(value_scale_ptr + entries).to(tl.float32)
            value_zero = tl.load(value_zero_ptr + entries).to(tl.float32)
            values = value_codes * value_scale[:, None] + value_zero[:, None]
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee") * scaling + bias[None, :]
        new_best = tl.maximum(best, tl.max(logits, 1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # −inf alone so far: weights 0
        weights = tl.exp(logits - shift[:, None])
        rescale = tl.exp(best - shift)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision="ieee")
        best = new_best
    tl.store(top_ptr + split * m + queries, best, mask=q_valid)
    tl.store(den_ptr + split * m + queries, total, mask=q_valid)
    tl.store(
        num_ptr + (split * m + queries)[:, None] * dv + value_channels[None, :],
        acc,
        mask=q_valid[:, None] & dv_valid[None, :],
    )


@triton.jit
def merge_splits_kernel(
    split_top_ptr, split_den_ptr, split_num_ptr, first_split_ptr,
    top_ptr, den_ptr, num_ptr,
    m, dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """A row's splits merged by their maximum logits (the log-sum-exp merge of split-K decoding): the row's
    maximum logit, and relative to it its weights' sum and weighted values; −inf, 0 and 0 for a row
    without pages."""
    row = tl.program_id(0)
    queries = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = queries < m
    value_channels = tl.arange(0, BLOCK_DV)
    both = q_valid[:, None] & (value_channels < dv)[None, :]
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for split in range(tl.load(first_split_ptr + row), tl.load(first_split_ptr + row + 1)):
        top = tl.load(split_top_ptr + split * m + queries, mask=q_valid, other=float("-inf"))
        den = tl.load(split_den_ptr + split * m + queries, mask=q_valid, other=0.0)
        at = (split * m + queries)[:, None] * dv + value_channels[None, :]
        num = tl.load(split_num_ptr + at, mask=both, other=0.0)
        new_best = tl.maximum(best, top)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # splits of −inf alone: weights 0
        rescale = tl.exp(best - shift)
        weight = tl.exp(top - shift)
        total = total * rescale + den * weight
        acc = acc * rescale[:, None] + num * weight[:, None]
        best = new_best
    tl.store(top_ptr + row * m + queries, best, mask=q_valid)
    tl.store(den_ptr + row * m + queries, total, mask=q_valid)
    tl.store(num_ptr + (row * m + queries)[:, None] * dv + value_channels[None, :], acc, mask=both)


@triton.jit(do_not_specialize=["rows", "n", "groups"])  # one compiled kernel whatever a forward's sizes
def max_logit_kernel(
    q_ptr, k_ptr, shift_ptr, out_ptr,
    rows, n, d, groups, k_head_stride, k_entry_stride, scaling,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """For one KV head, one block of ``BLOCK_N`` keys and one group of the head's query rows: each key's
    largest ``s·q·k + shift_q`` over the group's rows (``kvfold.runtime.key_scores``). The keys stay in
    registers while the rows go by in blocks of ``BLOCK_M``; only the running maximum is kept, no logit is
    written. 16-bit rows and keys are multiplied as they are with float32 sums (``UPCAST``: converted to
    float32 first, for Triton's interpreter, whose bfloat16 products are wrong)."""
    head = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a long cache's heads pass 2³¹ elements
    keys_at = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(2)
    per_group = rows // groups
    channels = tl.arange(0, BLOCK_D)
    k_valid = keys_at < n
    d_valid = channels < d
    keys = tl.load(
        k_ptr + head * k_head_stride + keys_at[:, None] * k_entry_stride + channels[None, :],
        mask=k_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        keys = keys.to(tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    first = group * per_group
    for lo in range(first, first + per_group, BLOCK_M):
        at = lo + tl.arange(0, BLOCK_M)
        r_valid = at < first + per_group
        q = tl.load(
            q_ptr + (head * rows + at)[:, None] * d + channels[None, :],
            mask=r_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        shift = tl.load(shift_ptr + head * rows + at, mask=r_valid, other=float("-inf"))
        if UPCAST:
            logits = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(keys))
        best = tl.maximum(best, tl.max(logits * scaling + shift[:, None], 0))
    tl.store(out_ptr + (head * groups + group) * n + keys_at, best, mask=k_valid)
