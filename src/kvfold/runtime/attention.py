"""The ``kvfold`` attention implementation: attention that adds each entry's log-mass β.

``logits_j = q·k_j · scaling + β_j`` (architecture guide, "the one idea"). Registration is
explicit: :func:`enable` registers the implementation and its mask function with transformers
and switches one model to it; ``import kvfold`` changes nothing.

Paths:

* **prefill of an empty layer** — exactly transformers' SDPA (so no compression equals the
  stock model); left padding found in the mask is recorded as β = −inf; the cache's prefill
  observers (if any) then see the layer's queries (e.g. H2O accumulates their attention).
* **a layer with stored rows** (per-head lengths, quantized entries: see
  :mod:`kvfold.runtime.folded_layer`) — the stored rows' part, each row's maximum logit, weights' sum and
  weighted values (:func:`kvfold.runtime.quantized_attention.stored_part`: the compiled kernel or
  PyTorch over the codes, batched gathers over full-precision rows), merged by log-sum-exp with the
  dense tail, whose last ``q`` entries are the new tokens (causal among themselves). A policy that
  reads the probabilities gets one softmax over the padded slots instead.
* **a dense layer, one query token** — the G query heads of a GQA group are folded into the
  query-length axis, so β of shape ``(B, H_kv, 1, N)`` broadcasts over them: no
  ``(B, heads, q, K)`` mask is built per step.
* **a dense layer, several query tokens** (question after compression, chunked prefill) — a
  float mask of β plus the causal block of the new tokens; on an uncompressed cache (a repeat
  pass, a chunked prefill before its first compression) the old entries and the new causal block
  are attended apart and merged by their log-sum-exp, with no mask.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.device_checks import checked_once, error_line, status_key
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quantized_attention import merge_with_tail, stored_part
from kvfold.runtime.rows import NEG_INF

ATTN_IMPLEMENTATION = "kvfold"


class OnlinePolicy(Protocol):
    """What the attention calls after each forward of a layer (decode-time compression)."""

    needs_attention: bool

    def after_forward(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: torch.Tensor,
        probs: torch.Tensor | None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Called after the attention of layer ``layer_idx`` (its cache already holds the new entries).

        Args:
            query: ``(B, H_q, q, D)`` this forward's query states.
            probs: ``(B, H_q, q, N)`` attention probabilities when ``needs_attention`` and the layer
                held a compressed or filled cache; None on a fresh prefill.
            logits: with ``probs``, the scaled scores ``q·k·scaling`` before β, ``(B, H_kv, G·q, N)``
                (the G query heads of a KV head folded into the query axis).

        A policy with ``accepts_log_sum_exp = True`` may instead be called with ``probs=None`` and
        the keywords ``log_sum_exp`` (``(B, H_q, q)``, each query's log-sum-exp over every entry,
        float32 or wider) and ``scaling`` (the logit scale) when the layer holds an uncompressed
        cache and several query tokens: it then computes from the keys only the probabilities it
        needs (``exp(q·k·scaling − log_sum_exp)``), and the attention runs the fused kernel
        instead of materialising every probability (:func:`_attend_after_cache`).

        Such a policy may also define ``context_entries(layer_idx) -> int | None``: a count ``m`` of
        leading entries (the context before a repeat pass) whose log-sum-exp it wants apart. On
        that path it is then called, with or without ``needs_attention``, with the keyword
        ``context_log_sum_exp`` (``(B, H_q, q)``, each query's log-sum-exp over entries ``0:m``),
        and ``log_sum_exp`` and ``scaling`` as above; elsewhere it gets neither keyword.
        """


def kvfold_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvfold_cache: FoldedCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention forward registered as ``attn_implementation="kvfold"``.

    Args follow transformers' attention interface: ``query`` ``(B, H_q, q, D)``, ``key`` and
    ``value`` ``(B, H_kv, K, D)`` (what the cache returned), ``attention_mask`` from the mask
    function. ``kvfold_cache`` is injected by the pre-hook that :func:`enable` installs.

    Returns:
        ``(output (B, q, H_q, D), None)``.
    """
    layer = kvfold_cache.layers[module.layer_idx] if kvfold_cache is not None else None
    if not isinstance(layer, FoldedLayer):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    if kvfold_cache.capture_window:
        _capture_queries(layer, query, kvfold_cache.capture_window)
    policy = kvfold_cache.policy
    need_probs = policy is not None and policy.needs_attention
    probs = logits = None
    if policy is not None:
        layer.unpack()  # a policy edits the dense entries in place
    if layer.stored is not None:
        _check_sliding_window(layer, kwargs.get("sliding_window"))
        if need_probs:
            out, probs, logits = _padded_attention(query, layer, scaling, need_probs)
        else:
            out = _stored_attention(query, layer, scaling)
    elif layer.physical_length == q_len and not layer.has_log_mass:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs
        )
        _record_padding(layer, attention_mask)  # probs stay None: policies score prefills themselves
        for observer in kvfold_cache.prefill_observers:
            observer(module.layer_idx, layer, query, scaling)
    else:
        _check_sliding_window(layer, kwargs.get("sliding_window"))
        split = _context_entries(policy, module.layer_idx)
        takes_lse = getattr(policy, "accepts_log_sum_exp", False) and (need_probs or split is not None)
        if takes_lse and _gives_log_sum_exp(query, layer):
            keys, values, _ = layer.tail()
            out, lse, *head = _attend_after_cache(query, keys, values, scaling, with_lse=True, split=split)
            extra = {"context_log_sum_exp": head[0]} if head else {}
            policy.after_forward(module.layer_idx, layer, query, None, None, log_sum_exp=lse, scaling=scaling, **extra)
            return out.transpose(1, 2), None
        else:
            out, probs, logits = _dense_attention(query, layer, scaling, need_probs)
    if policy is not None:
        policy.after_forward(module.layer_idx, layer, query, probs, logits)
    return out, None


def _context_entries(policy, layer_idx: int) -> int | None:
    """The leading entries whose log-sum-exp ``policy`` wants apart (:class:`OnlinePolicy`), or None."""
    ask = getattr(policy, "context_entries", None)
    return None if ask is None else ask(layer_idx)


def _stored_attention(query: torch.Tensor, layer: FoldedLayer, scaling: float) -> torch.Tensor:
    """Attention over a layer with stored rows: their part (with β) by
    :func:`~kvfold.runtime.quantized_attention.stored_part` (quantized rows read from their codes, the
    value scales folded into the probabilities; full-precision rows gathered, all rows at once), merged
    by log-sum-exp with the dense tail, whose last ``q`` entries are the new tokens (causal among
    themselves): one softmax over both. Nothing outlives the call.

    Returns:
        ``(B, q, H_q, D)``.
    """
    b, h_q, q_len, d = query.shape
    h_kv = layer.num_heads
    rows, m = b * h_kv, (h_q // h_kv) * q_len
    acc = torch.promote_types(query.dtype, torch.float32)
    folded = query.reshape(b, h_kv, m, d).to(acc)
    tail_keys, tail_values, tail_beta = layer.tail()
    fresh = _tail_logits(folded, tail_keys, tail_beta, q_len, scaling).view(rows, m, -1)
    tail_values = tail_values.reshape(rows, -1, tail_values.shape[-1]).to(acc)
    out = merge_with_tail(*stored_part(folded.view(rows, m, d), layer.stored, scaling), fresh, tail_values)
    return out.to(query.dtype).view(b, h_q, q_len, -1).transpose(1, 2)


def _tail_logits(
    folded: torch.Tensor, keys: torch.Tensor, beta: torch.Tensor | None, q_len: int, scaling: float
) -> torch.Tensor:
    """Scaled logits ``(B, H_kv, G·q, n)`` of the folded queries over a layer's dense tail (β added),
    with the future of each new token masked."""
    fresh = torch.matmul(folded, keys.transpose(-1, -2).to(folded.dtype)).mul_(scaling)
    if beta is not None:
        fresh.add_(beta[:, :, None, :].to(fresh.dtype))
    n_tail = keys.shape[2]
    if q_len > 1:  # query i sees the tail up to its own token
        position = torch.arange(folded.shape[2], device=folded.device) % q_len
        future = torch.arange(n_tail, device=folded.device)[None, :] > (n_tail - q_len + position)[:, None]
        fresh.masked_fill_(future, NEG_INF)
    return fresh


def _padded_attention(
    query: torch.Tensor, layer: FoldedLayer, scaling: float, need_probs: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention over a layer's stored rows padded for this layer only (dequantized, with β), then
    its dense tail, whose last ``q`` entries are the new tokens (causal among themselves): one
    softmax over the slots of :meth:`FoldedLayer.padded`, the G query heads of a KV head folded
    into the query axis. The path of policies that read the probabilities (a repeat pass over a
    compressed conversation).

    Returns:
        ``(output (B, q, H_q, D), probs, logits)`` as :func:`_dense_attention` returns them.
    """
    b, h_q, q_len, d = query.shape
    q_keys, q_values, q_beta = layer.stored_padded()
    tail_keys, tail_values, tail_beta = layer.tail()
    keys = torch.cat([q_keys, tail_keys.to(q_keys.dtype)], 2)
    values = torch.cat([q_values, tail_values.to(q_values.dtype)], 2)
    h_kv, n = keys.shape[1], keys.shape[2]
    groups = h_q // h_kv
    acc = torch.promote_types(query.dtype, torch.float32)
    folded = query.reshape(b, h_kv, groups * q_len, d)
    logits = torch.matmul(folded, keys.transpose(-1, -2)).to(acc).mul_(scaling)  # before β
    n_tail = tail_keys.shape[2]
    tail_bias = tail_beta.float() if tail_beta is not None else q_beta.new_zeros(b, h_kv, n_tail)
    bias = torch.cat([q_beta, tail_bias], -1)[:, :, None, :].to(acc)
    if q_len > 1:  # query i sees the tail up to its own token
        position = torch.arange(groups * q_len, device=query.device) % q_len
        future = torch.arange(n, device=query.device)[None, :] > (n - q_len + position)[:, None]
        bias = bias.masked_fill(future, NEG_INF)
    probs = torch.softmax(logits + bias, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values).to(query.dtype)
    out = out.reshape(b, h_q, q_len, -1).transpose(1, 2)
    if not need_probs:
        return out, None, None
    return out, probs.view(b, h_q, q_len, n), logits


def _dense_attention(
    query: torch.Tensor, layer: FoldedLayer, scaling: float, need_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention over the dense layout with β.

    Returns:
        ``(output (B, q, H_q, D), probs, logits)``; with ``need_probs`` the probabilities
        ``(B, H_q, q, N)`` and the scaled scores before β ``(B, H_kv, G·q, N)``, else None.
    """
    b, h_q, q_len, d = query.shape
    keys, values, log_mass = layer.tail()
    h_kv, n = keys.shape[1], keys.shape[2]
    groups = h_q // h_kv
    if log_mass is None and q_len > 1 and not need_probs:
        # Uncompressed cache (a repeat pass, a chunked prefill before compression).
        return _attend_after_cache(query, keys, values, scaling).transpose(1, 2), None, None
    # Fold the G query heads of each KV head into the query axis: (B, H_kv, G·q, D).
    folded = query.reshape(b, h_kv, groups * q_len, d)
    bias = _dense_bias(layer, q_len, groups, query.dtype)
    if need_probs:
        acc = torch.promote_types(query.dtype, torch.float32)
        logits = torch.matmul(folded, keys.transpose(-1, -2)).to(acc) * scaling
        probs = torch.softmax(logits if bias is None else logits + bias, dim=-1)
        out = torch.matmul(probs.to(values.dtype), values)
        probs = probs.view(b, h_q, q_len, n)
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scaling)
        probs = logits = None
    out = out.reshape(b, h_q, q_len, d).transpose(1, 2)
    return out, probs, logits


FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""The CPU flash-attention kernel that also returns each query's log-sum-exp (None in builds without it)."""
CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16)
"""Query dtypes :data:`FLASH_WITH_LSE` takes."""
DEVICE_FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""Query dtypes CUDA's flash kernel takes (:func:`device_flash`)."""


def _cuda_flash_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout: float, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's flash-attention kernel with each query's log-sum-exp, called as :data:`FLASH_WITH_LSE`
    is: ``(output (B, H, q, D), log-sum-exp (B, H, q) float32)``."""
    found = torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, dropout, causal, False, scale=scale)
    return found[0], found[1]


DEVICE_FLASH_KERNEL = _cuda_flash_with_lse
"""The fused kernel :func:`device_flash` checks and hands out (tests put the CPU's in its place)."""
DEVICE_FLASH_STATUS: dict[str, str] = {}
"""Per device and dtype (``"cuda:0 torch.bfloat16"``), whether :func:`device_flash` found the fused
kernel: ``"fused"``, or ``"blocked log-sum-exp (why)"``."""


def device_flash(query: torch.Tensor):
    """The fused kernel that gives each query's log-sum-exp off the CPU, or None: CUDA's flash
    attention for 16-bit queries (head dimension at most 256), checked once per device and dtype
    against :func:`_attend_after_cache_split` on a small problem (:data:`DEVICE_FLASH_STATUS` says
    what was found). Where it applies, the repeat pass's log-sum-exp over the whole cache runs in the
    kernel the model's own attention runs in, not as float32 products: at 32K tokens of
    Llama-3.1-8B's shape those are about 280 TFLOP, several prefills on an H200."""
    if query.device.type != "cuda" or query.dtype not in DEVICE_FLASH_DTYPES or query.shape[-1] > 256:
        return None
    found = checked_once(
        DEVICE_FLASH_STATUS, query.device, query.dtype, lambda: _check_device_flash(query.device, query.dtype)
    )
    return DEVICE_FLASH_KERNEL if found == "fused" else None


def log_sum_exp_path(device: torch.device, dtype: torch.dtype) -> str:
    """How the attention over an uncompressed cache gives each query's log-sum-exp (the repeat pass)
    for queries of ``dtype`` on ``device``: ``"fused (CPU kernel)"``, ``"fused (CUDA flash kernel)"``
    or ``"blocked log-sum-exp (why)"`` (float32 products in blocks)."""
    if device.type == "cpu":
        on_cpu = FLASH_WITH_LSE is not None and dtype in CPU_FLASH_DTYPES
        return "fused (CPU kernel)" if on_cpu else f"blocked log-sum-exp ({dtype} on the CPU)"
    if device.type != "cuda" or dtype not in DEVICE_FLASH_DTYPES:
        return f"blocked log-sum-exp ({dtype} on {device.type}: the flash kernel takes 16-bit queries on CUDA)"
    return DEVICE_FLASH_STATUS.get(status_key(device, dtype), "blocked log-sum-exp (not checked on this device yet)")


def _check_device_flash(device: torch.device, dtype: torch.dtype) -> str:
    """``"fused"`` when :data:`DEVICE_FLASH_KERNEL` gives :func:`_attend_after_cache_split`'s output
    and log-sum-exp on a small GQA problem (2 KV heads of 3 query heads, 7 new tokens after 40),
    else ``"blocked log-sum-exp (why)"``."""
    gen = torch.Generator().manual_seed(0)
    b, h_kv, groups, q_len, n, d = 1, 2, 3, 7, 47, 64
    parts = [torch.randn(b, h, m, d, generator=gen) for h, m in ((h_kv * groups, q_len), (h_kv, n), (h_kv, n))]
    query, keys, values = (t.to(device=device, dtype=dtype) for t in parts)
    try:
        out, lse, _ = _attend_fused(DEVICE_FLASH_KERNEL, query, keys, values, d**-0.5)
    except RuntimeError as err:  # a build or device without the kernel
        return f"blocked log-sum-exp ({error_line(err)})"
    ref_out, ref_lse = _attend_after_cache_split(query, keys, values, d**-0.5, with_lse=True)
    out_off = float((out.float() - ref_out.float()).abs().max())
    lse_off = float((lse.float() - ref_lse.float()).abs().max())
    if out_off > 0.05 or lse_off > 0.05:
        return f"blocked log-sum-exp (the fused kernel is off by {out_off:.3g} in output, {lse_off:.3g} in log-sum-exp)"
    return "fused"


def _gives_log_sum_exp(query: torch.Tensor, layer: FoldedLayer) -> bool:
    """True when :func:`_attend_after_cache` gives each query's log-sum-exp for ``query`` on
    ``layer`` to a policy that accepts it: several new tokens on an uncompressed dense cache, with
    older entries before them, and either the fused CPU kernel (float32 or bfloat16) or a device
    other than the CPU (:func:`_attend_after_cache_split`). Other CPU queries (float64) keep the
    probability path."""
    q_len = query.shape[2]
    uncompressed = (
        not layer.has_log_mass  # no stored rows, and every β of the tail 0
        and q_len > 1
        and layer.physical_length > q_len
    )
    return uncompressed and (_cpu_flash(query) or not _is_cpu(query.device))


def _cpu_flash(query: torch.Tensor) -> bool:
    """The fused CPU kernel applies: a CPU query in float32 or bfloat16, a build that has it."""
    return FLASH_WITH_LSE is not None and query.device.type == "cpu" and query.dtype in CPU_FLASH_DTYPES


def _is_cpu(device: torch.device) -> bool:
    """Whether ``device`` is the CPU (tests patch it to run the other devices' path here)."""
    return device.type == "cpu"


def _attend_after_cache(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    with_lse: bool = False,
    split: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Attention of ``q`` new tokens over an uncompressed cache whose last ``q`` entries are
    theirs: every older entry is visible, the new ones causally. Returns ``(B, H_q, q, D)``, and
    with ``with_lse`` each query's log-sum-exp over every entry, ``(B, H_q, q)`` float32 (float64
    for float64 queries); with ``with_lse`` and ``split`` (``m``) also the log-sum-exp over the
    first ``m`` old entries alone (−inf for ``m = 0``): on the fused path the old entries are then
    attended in two calls, ``0:m`` and the rest, merged as the new block is.

    The two parts are computed apart and merged by their log-sum-exp (the block decomposition of
    attention, Zweiger et al. 2026 §2): the old entries with no mask and the G query heads of a KV
    head folded into the query axis, the new block with the kernel's own causal mask. Neither part
    reads a mask, and the masked half of the new block is skipped (Attention Matching's repeat pass
    on SmolLM2 at 4K tokens: 19.9 → 18.4 s). On the CPU the fused kernel gives both parts'
    log-sum-exp, on CUDA in 16 bits its flash kernel (:func:`device_flash`); elsewhere
    :func:`_attend_after_cache_split` computes them in blocks.
    """
    flash = FLASH_WITH_LSE if _cpu_flash(query) else device_flash(query)
    if flash is None or keys.shape[2] <= query.shape[2]:
        return _attend_after_cache_split(query, keys, values, scaling, with_lse, split)
    out, lse, head = _attend_fused(flash, query, keys, values, scaling, split)
    if not with_lse:
        return out
    return (out, lse) if split is None else (out, lse, head)


def _attend_fused(
    flash, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, split: int | None = None
):
    """:func:`_attend_after_cache` by a fused kernel that gives the log-sum-exp (``flash``, called as
    :data:`FLASH_WITH_LSE`), with older entries than the new ones: ``(output, log-sum-exp, the
    log-sum-exp over the first split entries or None)``."""
    b, h_q, q_len, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    old = n - q_len
    groups = h_q // h_kv
    folded = query.reshape(b, h_kv, groups * q_len, d)
    cut = old if split is None or split <= 0 else min(split, old)
    out_old, lse_old = flash(folded, keys[:, :, :cut], values[:, :, :cut], 0.0, False, scale=scaling)
    head = None if split is None else lse_old.reshape(b, h_q, q_len)
    if split is not None and split <= 0:
        head = torch.full_like(head, float("-inf"))
    if cut < old:  # the rest of the old entries: a second call, merged by the two log-sum-exps
        out_rest, lse_rest = flash(folded, keys[:, :, cut:old], values[:, :, cut:old], 0.0, False, scale=scaling)
        out_old, lse_old = _merge_two(out_old, lse_old, out_rest, lse_rest)
    new_keys = keys[:, :, old:].repeat_interleave(groups, dim=1)
    new_values = values[:, :, old:].repeat_interleave(groups, dim=1)
    out_new, lse_new = flash(query, new_keys, new_values, 0.0, True, scale=scaling)
    out, lse = _merge_parts(query, out_old, lse_old.reshape(b, h_q, q_len), out_new, lse_new, True)
    return out, lse, head


def _merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Attention over two disjoint sets of entries from each set's output ``(..., q, D)`` and
    log-sum-exp ``(..., q)`` (§2's block decomposition): ``(output in float32 or wider, log-sum-exp)``."""
    acc = torch.promote_types(out_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.to(acc) * (lse_a - lse).exp()[..., None] + out_b.to(acc) * (lse_b - lse).exp()[..., None]
    return out, lse


def _merge_parts(
    query: torch.Tensor,
    out_old: torch.Tensor,
    lse_old: torch.Tensor,
    out_new: torch.Tensor,
    lse_new: torch.Tensor,
    with_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The attention over both parts from each part's output (``out_old`` with the query heads
    folded) and log-sum-exp ``(B, H_q, q)``: the weights ``exp(lse_part − lse)`` (§2's block
    decomposition), in float32 at least; with ``with_lse`` also the merged log-sum-exp."""
    acc = torch.promote_types(query.dtype, torch.float32)
    lse = torch.logaddexp(lse_old, lse_new)
    weight_old = (lse_old - lse).exp_()[..., None]
    weight_new = (lse_new - lse).exp_()[..., None]
    out = out_old.reshape(out_new.shape).to(acc) * weight_old + out_new.to(acc) * weight_new
    return (out.to(query.dtype), lse) if with_lse else out.to(query.dtype)


LSE_BLOCK_ELEMENTS = 1 << 25
"""At most this many logits in one block of :func:`log_sum_exp_parts` on the CPU (128 MB in float32)."""
ACCELERATOR_BLOCK_ELEMENTS = 1 << 27
"""Logits (all KV heads together) of one block off the CPU, where each operation is a launch: 512 MB
in float32, for :func:`log_sum_exp_parts` and KVzip's scores (:func:`kvfold.methods.core.repeat.max_received`).
At 32K entries of Llama-3.1-8B's 8 KV heads a block of the CPU's size held 122 query rows, and a
repeat forward's 2,048 rows took 17 blocks of about 8 launches a layer; this one holds 490 rows."""
ACCELERATOR_LSE_BLOCK_ELEMENTS = ACCELERATOR_BLOCK_ELEMENTS
""":func:`log_sum_exp_parts`'s blocks off the CPU (tests shrink them apart from the scores')."""


def _attend_after_cache_split(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    with_lse: bool = False,
    split: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`_attend_after_cache` on any device: the old entries through SDPA with no mask (the
    G query heads of a KV head folded into the query axis), the new block through SDPA's own
    causal mask with its keys repeated per query head, merged by the log-sum-exp of each part from
    :func:`log_sum_exp_parts`. No mask is built and no kernel sees one: on CUDA a float mask, or
    ``enable_gqa`` with a mask, can send SDPA to its math kernel, which holds every ``(q, N)``
    probability of every head. ``split``: as :func:`_attend_after_cache` (the log-sum-exp over the
    first ``split`` old entries, from the same blocks of products)."""
    b, h_q, q_len, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    groups = h_q // h_kv
    old = n - q_len
    new_keys = keys[:, :, old:].repeat_interleave(groups, dim=1)
    new_values = values[:, :, old:].repeat_interleave(groups, dim=1)
    out_new = F.scaled_dot_product_attention(query, new_keys, new_values, is_causal=True, scale=scaling)
    if old <= 0 and not with_lse:
        return out_new
    lse_old, lse_new, *head = log_sum_exp_parts(query, keys, scaling, split if with_lse else None)
    if old <= 0:
        return (out_new, lse_new, *head)
    folded = query.reshape(b, h_kv, groups * q_len, d)
    out_old = F.scaled_dot_product_attention(folded, keys[:, :, :old], values[:, :, :old], scale=scaling)
    merged = _merge_parts(query, out_old, lse_old, out_new, lse_new, with_lse)
    return (*merged, *head) if with_lse else merged


def log_sum_exp_parts(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, split: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Each new query's log-sum-exp ``log Σ_j exp(s·q·k_j)`` over the old entries and, apart, over
    the new ones it sees (causally): two ``(B, H_q, q)`` tensors in float32 (float64 for float64
    queries); −inf where a part is empty. With ``split`` (``m``) a third: over the first ``m`` old
    entries alone.

    Computed in blocks of query rows, at most :data:`LSE_BLOCK_ELEMENTS` logits
    (:data:`ACCELERATOR_LSE_BLOCK_ELEMENTS` off the CPU) and ``4·D`` rows a KV head (few kernel
    launches on a GPU, bounded memory everywhere)."""
    b, h_q, q_len, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    groups = h_q // h_kv
    old = n - q_len
    acc = torch.promote_types(query.dtype, torch.float32)
    folded = query.reshape(b * h_kv, groups * q_len, d)
    key_t = keys.reshape(b * h_kv, n, d).transpose(1, 2).to(acc)  # once: not a float32 copy of the keys per block
    lse_old = torch.empty(b * h_kv, groups * q_len, dtype=acc, device=query.device)
    lse_new = torch.empty_like(lse_old)
    cut = None if split is None else min(max(split, 0), old)
    lse_head = None if cut is None else torch.empty_like(lse_old)
    elements = LSE_BLOCK_ELEMENTS if _is_cpu(query.device) else ACCELERATOR_LSE_BLOCK_ELEMENTS
    rows = max(1, min(elements // max(1, b * h_kv * n), 4 * d))
    position = torch.arange(groups * q_len, device=query.device) % q_len  # each folded row's query
    new_keys = torch.arange(q_len, device=query.device)
    for lo in range(0, groups * q_len, rows):
        hi = min(lo + rows, groups * q_len)
        logits = torch.matmul(folded[:, lo:hi].to(acc), key_t).mul_(scaling)
        lse_old[:, lo:hi] = torch.logsumexp(logits[..., :old], dim=-1)
        if lse_head is not None:
            lse_head[:, lo:hi] = torch.logsumexp(logits[..., :cut], dim=-1)
        future = new_keys[None, :] > position[lo:hi, None]  # (rows, q): a new entry after the query
        lse_new[:, lo:hi] = torch.logsumexp(logits[..., old:].masked_fill_(future, float("-inf")), dim=-1)
        del logits  # before the next block's: one block held, not two
    shape = (b, h_kv, groups, q_len)
    parts = (lse_old, lse_new) if lse_head is None else (lse_old, lse_new, lse_head)
    return tuple(part.view(shape).reshape(b, h_q, q_len) for part in parts)


def _dense_bias(layer: FoldedLayer, q_len: int, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive bias for the folded query: β over old entries, causal over the new ``q_len``."""
    _, _, log_mass = layer.tail()
    n = layer.physical_length
    if q_len == 1:
        if log_mass is None:
            return None
        return log_mass[:, :, None, :].to(dtype)  # (B, H_kv, 1, N): broadcast over the G heads
    device = layer.device
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    allowed = torch.ones(q_len, n, dtype=torch.bool, device=device)
    allowed[:, n - q_len :] = causal
    mask = torch.zeros(q_len, n, dtype=torch.float32, device=device).masked_fill(~allowed, NEG_INF)
    if log_mass is None:
        mask = mask[None, None]
        return mask.expand(1, 1, q_len, n).repeat(1, 1, groups, 1).to(dtype)
    full = log_mass[:, :, None, :] + mask[None, None]  # (B, H_kv, q, N)
    b, h_kv = full.shape[:2]
    return full[:, :, None].expand(b, h_kv, groups, q_len, n).reshape(b, h_kv, groups * q_len, n).to(dtype)


def _record_padding(layer: FoldedLayer, attention_mask: torch.Tensor | None) -> None:
    """Mark left-padding entries (from the prefill mask) with β = −inf."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return
    valid = attention_mask[:, 0, -1, :]  # the last query row sees every non-padding token
    if valid.shape[-1] != layer.physical_length or bool(valid.all()):
        return
    log_mass = torch.zeros(layer.batch_size, layer.num_heads, valid.shape[-1], device=valid.device)
    log_mass = log_mass.masked_fill(~valid[:, None, :], NEG_INF)
    layer.set_log_mass(log_mass)


def _capture_queries(layer: FoldedLayer, query: torch.Tensor, window: int) -> None:
    """Keep the last ``window`` query states of the prefill (SnapKV / GRKV windows)."""
    recent = query[:, :, -window:].detach()
    if layer.captured_queries is not None and recent.shape[2] < window:
        recent = torch.cat([layer.captured_queries, recent], dim=2)[:, :, -window:]
    layer.captured_queries = recent.clone()


def _check_sliding_window(layer: FoldedLayer, sliding_window: int | None) -> None:
    if sliding_window is not None and layer.logical_length > sliding_window:
        raise NotImplementedError(
            f"this model uses sliding-window attention ({sliding_window} tokens) and the context is longer; "
            "kvfold compresses full-attention layers only. Use a shorter context or a model without a "
            "sliding window on these layers."
        )


def register() -> None:
    """Register the ``kvfold`` attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvfold_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _inject_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = kwargs.get("past_key_values")
    if isinstance(cache, FoldedCache):
        kwargs["kvfold_cache"] = cache
    return args, kwargs


def is_attention_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a decoder layer's attention: it has ``layer_idx`` and ``o_proj`` (the decoders
    of :data:`kvfold.runtime.models.SUPPORTED_MODEL_TYPES`)."""
    return hasattr(module, "layer_idx") and hasattr(module, "o_proj")


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The attention module of every decoder layer by layer index, in layer order (the first module
    found for an index; see :func:`is_attention_module`). Empty when the model has none."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if is_attention_module(module):
            found.setdefault(int(module.layer_idx), module)
    return dict(sorted(found.items()))


def attention_scalings(model: torch.nn.Module) -> dict[int, float | None]:
    """The logit scale of every attention module by layer index: ``float(module.scaling)``, or None
    where the module has no ``scaling`` (callers choose the fallback, usually ``head_dim**-0.5``)."""
    found: dict[int, float | None] = {}
    for layer_idx, module in attention_modules(model).items():
        scaling = getattr(module, "scaling", None)
        found[layer_idx] = None if scaling is None else float(scaling)
    return found


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` to the kvfold attention (explicit; nothing happens at import).

    Registers the implementation, sets ``attn_implementation="kvfold"`` and installs a forward
    pre-hook on every attention module that hands a :class:`FoldedCache` to the attention
    function. With any other cache (or none) the model computes exactly as with SDPA.

    Returns:
        The same model.
    """
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hooked = 0
    for module in model.modules():
        if is_attention_module(module) and not getattr(module, "_kvfold_hooked", False):
            module.register_forward_pre_hook(_inject_cache, with_kwargs=True)
            module._kvfold_hooked = True
            hooked += 1
        elif getattr(module, "_kvfold_hooked", False):
            hooked += 1
    if hooked == 0:
        raise UserError(
            f"{type(model).__name__}: found no attention modules with `layer_idx` and `o_proj`; "
            "kvfold supports Llama, Mistral, Qwen, OLMo 2, Granite, Phi-3 and Gemma3-style decoders"
        )
    return model
