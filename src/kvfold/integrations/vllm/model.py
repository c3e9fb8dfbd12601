"""vLLM's Llama on kvfold's attention backend.

Every attention layer is given :class:`~kvfold.integrations.vllm.backend.KvfoldAttentionBackend`
through ``Attention(..., attn_backend=...)``: vLLM's ``CPU_ATTN`` for every request (heads keep their
width, so a request that names no cache file holds what stock vLLM holds), and kvfold's attention
for the requests on cache files. vLLM's choice of backend for other models is untouched.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["KvfoldLlamaAttention", "KvfoldLlamaDecoderLayer", "KvfoldLlamaForCausalLM"]


class KvfoldLlamaAttention(LlamaAttention):
    """:class:`LlamaAttention` whose attention layer runs kvfold's backend (module docstring)."""

    def __init__(self, *args, prefix: str = "", **kwargs) -> None:
        super().__init__(*args, prefix=prefix, **kwargs)
        from vllm.config import get_current_vllm_config

        from kvfold.integrations.vllm.backend import KvfoldAttentionBackend

        stock = self.attn
        name = f"{prefix}.attn"
        context = get_current_vllm_config().compilation_config.static_forward_context
        context.pop(name, None)  # the stock layer registered itself under this name; this one takes it
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


class KvfoldLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`KvfoldLlamaAttention`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=KvfoldLlamaAttention)


class KvfoldLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama on kvfold's attention backend; served as architecture ``KvfoldLlamaForCausalLM``
    (``hf_overrides={"architectures": ["KvfoldLlamaForCausalLM"]}``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=KvfoldLlamaDecoderLayer)
