"""A Llama model for vLLM whose attention heads are one slot wider, so that a cache entry carries β.

kvfold's attention adds a per-entry log-mass β to the logits, ``q·k_j·scale + β_j``. vLLM's
attention kernels have no per-entry bias (on the CPU, vLLM always runs its own ``CPU_ATTN`` kernel),
but they take the softmax scale apart from the head size. So each head is widened from ``D`` to
the next head size the kernels support (64 → 80 for SmolLM2): queries become ``[q, 1, 0…]``, keys
``[k, β/scale, 0…]`` and values ``[v, 0…]``. Then the stock kernel computes
``scale·(q·k + β/scale) = q·k·scale + β``, and the output's first ``D`` channels are the attention
of the narrow head. Keys computed by the model itself (prompt and generated tokens) carry β = 0, so
a request that names no kvfold cache is computed as by vLLM's own ``LlamaForCausalLM`` (the extra
channels add zeros). Entries loaded from a kvfold cache carry their β in channel ``D``
(:mod:`kvfold.integrations.vllm.layout`).

The cost: the KV cache holds ``wide / D`` times the bytes of the narrow model (80/64 = 1.25 for
SmolLM2), for every request.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

from kvfold.integrations.vllm.layout import wide_head_size

__all__ = ["KvfoldLlamaAttention", "KvfoldLlamaDecoderLayer", "KvfoldLlamaForCausalLM"]


class KvfoldLlamaAttention(LlamaAttention):
    """:class:`LlamaAttention` whose attention runs on heads widened by a β channel (module docstring)."""

    def __init__(self, *args, prefix: str = "", **kwargs) -> None:
        super().__init__(*args, prefix=prefix, **kwargs)
        from vllm.config import get_current_vllm_config

        narrow = self.attn
        name = f"{prefix}.attn"
        context = get_current_vllm_config().compilation_config.static_forward_context
        context.pop(name, None)  # the narrow layer registered itself under this name; the wide one takes it
        self.wide_head_dim = wide_head_size(self.head_dim)
        self.attn = Attention(
            self.num_heads,
            self.wide_head_dim,
            self.scaling,  # the narrow head's scale: β/scale in channel D then adds β to the logit
            num_kv_heads=self.num_kv_heads,
            cache_config=kwargs.get("cache_config"),
            quant_config=kwargs.get("quant_config"),
            per_layer_sliding_window=getattr(narrow, "sliding_window", None),
            prefix=name,
        )

    def _widen(self, x: torch.Tensor, heads: int, first: float) -> torch.Tensor:
        """``(N, heads·D)`` → ``(N, heads·W)``: channel D set to ``first``, the rest of the new ones 0."""
        n = x.shape[0]
        out = x.new_zeros(n, heads, self.wide_head_dim)
        out[:, :, : self.head_dim] = x.view(n, heads, self.head_dim)
        if first:
            out[:, :, self.head_dim] = first
        return out.view(n, heads * self.wide_head_dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        q = self._widen(q, self.num_heads, 1.0)
        k = self._widen(k, self.num_kv_heads, 0.0)  # β = 0 for the tokens the model computes
        v = self._widen(v, self.num_kv_heads, 0.0)
        wide = self.attn(q, k, v)
        n = wide.shape[0]
        narrow = wide.view(n, self.num_heads, self.wide_head_dim)[:, :, : self.head_dim].reshape(n, -1)
        output, _ = self.o_proj(narrow)
        return output


class KvfoldLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`KvfoldLlamaAttention`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=KvfoldLlamaAttention)


class KvfoldLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with a β channel in every attention head; served as architecture
    ``KvfoldLlamaForCausalLM`` (``hf_overrides={"architectures": ["KvfoldLlamaForCausalLM"]}``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=KvfoldLlamaDecoderLayer)


class KvfoldPoolLlamaAttention(LlamaAttention):
    """:class:`LlamaAttention` whose attention layer runs kvfold's backend
    (:class:`~kvfold.integrations.vllm.backend.KvfoldAttentionBackend`): heads keep their width, and a
    request on a cache file reads the file's rows from its blocks."""

    def __init__(self, *args, prefix: str = "", **kwargs) -> None:
        super().__init__(*args, prefix=prefix, **kwargs)
        from vllm.config import get_current_vllm_config

        from kvfold.integrations.vllm.backend import KvfoldAttentionBackend

        stock = self.attn
        name = f"{prefix}.attn"
        get_current_vllm_config().compilation_config.static_forward_context.pop(name, None)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=kwargs.get("cache_config"),
            quant_config=kwargs.get("quant_config"),
            per_layer_sliding_window=getattr(stock, "sliding_window", None),
            prefix=name,
            attn_backend=KvfoldAttentionBackend,
        )


class KvfoldPoolLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`KvfoldPoolLlamaAttention`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=KvfoldPoolLlamaAttention)


class KvfoldPoolLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama on kvfold's attention backend; served as architecture ``KvfoldPoolLlamaForCausalLM``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=KvfoldPoolLlamaDecoderLayer)
