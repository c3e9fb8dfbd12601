"""KVzip+'s normalization of the repeat pass's attention (Jégou & Jeblick 2026, *KVzap*, arXiv:2601.07891,
the KVzip+ score; NVIDIA kvpress ``KVzipPress(kvzip_plus_normalization=True)``).

KVzip scores an entry ``i`` by the largest attention probability ``a_{h,t,i}`` it receives from a
repeat query ``t`` of a query head ``h``. KVzip+ scores it by what it adds to the query's residual
stream, relative to that stream::

    s_i = max_h max_t  a_{h,t,i} · ‖W_Oʰ v_i‖ / ‖x_t‖

* ``x_t``: the hidden state **entering the layer's attention module** for repeat token ``t``, that
  is after the decoder layer's input layernorm (kvpress reads the attention module's
  ``hidden_states`` argument; so does :class:`HiddenNorms`), one norm per token shared by all heads;
* ``W_Oʰ = W_O[:, h·D:(h+1)·D]``: query head ``h``'s columns of ``o_proj`` (its bias excluded), and
  ``v_i`` the value of the KV head that query head ``h`` reads (``h // G``). With GQA the product
  is formed **per query head** and the max runs over the group afterwards, as in kvpress: each
  query head weighs the shared value by its own output projection.

The row normalization happens before the max over the queries (a max over normalized attention).
"""

from __future__ import annotations

import torch

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import attention_module, o_proj_weight

Tensor = torch.Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' models)."""
    return torch.promote_types(dtype, torch.float32)


class HiddenNorms:
    """Records ``‖x_t‖`` of each attention module's input during a repeat pass (a context manager:
    forward pre-hooks on the attention modules while it is open).

    Attributes:
        norms: per layer, ``(B, q)`` the norms of the latest forward's attention input (float32,
            float64 for float64 models).
    """

    def __init__(self, ctx: CompressionContext) -> None:
        self.ctx = ctx
        self.norms: dict[int, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> HiddenNorms:
        for layer_idx, _ in self.ctx.cache.folded_layers:
            module = attention_module(self.ctx, layer_idx)
            self._handles.append(module.register_forward_pre_hook(self._record, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.norms[int(module.layer_idx)] = hidden.detach().to(accumulation_dtype(hidden.dtype)).norm(dim=-1)

    def output_value_norms(self, layer_idx: int, values: Tensor) -> Tensor:
        """``‖W_Oʰ v_i‖`` of layer ``layer_idx``'s entries (:func:`output_value_norms`)."""
        return output_value_norms(o_proj_weight(self.ctx, layer_idx), values)


def output_value_norms(weight: Tensor, values: Tensor) -> Tensor:
    """``‖W_Oʰ v_i‖₂`` for every query head ``h`` and entry ``i``: the entry's value projected by the
    head's columns of ``o_proj``.

    Computed as ``√(vᵀ (W_Oʰᵀ W_Oʰ) v)``: one ``D × D`` Gram matrix per query head instead of a
    ``hidden``-wide projection of every entry.

    Args:
        weight: ``(hidden, H_q·D)`` the ``o_proj`` weight.
        values: ``(B, H_kv, N, D)``; query head ``h`` reads KV head ``h // G``.

    Returns:
        ``(B, H_q, N)`` float32 (float64 for float64 inputs).
    """
    acc = accumulation_dtype(values.dtype)
    batch, heads_kv, n, dim = values.shape
    heads_q = weight.shape[1] // dim
    columns = weight.to(acc).reshape(weight.shape[0], heads_q, dim).permute(1, 2, 0)  # (H_q, D, hidden) = W_Oʰᵀ
    gram = columns @ columns.transpose(-1, -2)  # (H_q, D, D)
    v = values.to(acc).repeat_interleave(heads_q // heads_kv, dim=1)  # (B, H_q, N, D)
    return ((v @ gram) * v).sum(dim=-1).clamp_min(0).sqrt()


def weighted_received(probs: Tensor, row_norms: Tensor, column_weights: Tensor, heads_kv: int) -> Tensor:
    """KVzip+'s score from materialised probabilities: ``max_h max_t a_{h,t,i} / ‖x_t‖ · w_{h,i}``.

    Args:
        probs: ``(B, H_q, q, N)`` attention probabilities of the context entries.
        row_norms: ``(B, q)`` ``‖x_t‖`` of each query token.
        column_weights: ``(B, H_q, N)`` ``‖W_Oʰ v_i‖``.
        heads_kv: ``H_kv`` (query head ``h`` belongs to KV head ``h // G``).

    Returns:
        ``(B, H_kv, N)`` float32 (float64 for float64 probabilities).
    """
    acc = accumulation_dtype(probs.dtype)
    normalized = probs.to(acc) / row_norms.to(acc)[:, None, :, None]  # each row divided before the max
    weighted = normalized.amax(dim=2) * column_weights.to(acc)
    batch, heads_q, n = weighted.shape
    return weighted.reshape(batch, heads_kv, heads_q // heads_kv, n).amax(dim=2)
