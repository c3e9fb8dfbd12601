"""vLLM's Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Granite and Phi-3 on kvfold's
attention backend.

Each served class is vLLM's own model class, built as vLLM builds it; then every attention layer
(vLLM's ``Attention``) is rebuilt with the same heads, scale, window and name and
:class:`~kvfold.integrations.vllm.backend.KvfoldAttentionBackend` (:func:`use_kvfold_attention`):
vLLM's ``CPU_ATTN`` for every request (heads keep their width, so a request that names no cache file
holds what stock vLLM holds), and kvfold's attention for the requests on cache files. Projections,
biases (Qwen2), query and key norms (Qwen3) and RoPE stay vLLM's, so the keys the backend receives are
the keys transformers' model gives ``kvfold compress``. vLLM's choice of backend for other models is
untouched.
"""

from __future__ import annotations

from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = [
    "KvfoldGraniteForCausalLM",
    "KvfoldLlamaForCausalLM",
    "KvfoldMistralForCausalLM",
    "KvfoldMixtralForCausalLM",
    "KvfoldPhi3ForCausalLM",
    "KvfoldQwen2ForCausalLM",
    "KvfoldQwen2MoeForCausalLM",
    "KvfoldQwen3ForCausalLM",
    "KvfoldQwen3MoeForCausalLM",
    "on_kvfold_attention",
    "use_kvfold_attention",
]


def use_kvfold_attention(model: nn.Module) -> int:
    """Rebuild every attention layer of ``model`` (vLLM's ``Attention``, held as a module's ``attn``) on
    kvfold's backend, under the name the stock layer registered, and return how many were rebuilt.

    Call it inside the model's ``__init__`` (vLLM's current config is the one being loaded). A layer
    with ALiBi, a logit soft cap or an attention sink is refused: the families served have none, and
    kvfold's kernel computes none of them.

    Raises:
        ValueError: an attention layer with one of those (the model is not of a served family).
    """
    from kvfold.integrations.vllm.backend import KvfoldAttentionBackend

    vllm_config = get_current_vllm_config()
    context = vllm_config.compilation_config.static_forward_context
    rebuilt = 0
    for owner in list(model.modules()):
        stock = getattr(owner, "attn", None)
        if type(stock) is not Attention:
            continue
        impl = stock.impl
        if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "logits_soft_cap", None) or stock.has_sink:
            raise ValueError(f"{stock.layer_name}: ALiBi, a logit soft cap or sinks are not served by kvfold")
        context.pop(stock.layer_name, None)  # the stock layer registered itself under this name; this one takes it
        owner.attn = Attention(
            stock.num_heads,
            stock.head_size,
            impl.scale,
            num_kv_heads=stock.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=stock.quant_config,
            per_layer_sliding_window=stock.sliding_window,
            prefix=stock.layer_name,
            attn_backend=KvfoldAttentionBackend,
        )
        rebuilt += 1
    return rebuilt


def on_kvfold_attention(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator for a subclass of one of vLLM's model classes: its ``__init__`` builds the model as
    vLLM's class does, then runs :func:`use_kvfold_attention` on it."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super(cls, self).__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        use_kvfold_attention(self)

    cls.__init__ = __init__
    return cls


@on_kvfold_attention
class KvfoldLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama on kvfold's attention backend (architecture ``KvfoldLlamaForCausalLM``)."""


@on_kvfold_attention
class KvfoldMistralForCausalLM(MistralForCausalLM):
    """vLLM's Mistral on kvfold's attention backend (architecture ``KvfoldMistralForCausalLM``)."""


@on_kvfold_attention
class KvfoldQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2 on kvfold's attention backend (architecture ``KvfoldQwen2ForCausalLM``)."""


@on_kvfold_attention
class KvfoldQwen3ForCausalLM(Qwen3ForCausalLM):
    """vLLM's Qwen3 on kvfold's attention backend (architecture ``KvfoldQwen3ForCausalLM``)."""


@on_kvfold_attention
class KvfoldMixtralForCausalLM(MixtralForCausalLM):
    """vLLM's Mixtral on kvfold's attention backend (architecture ``KvfoldMixtralForCausalLM``)."""


@on_kvfold_attention
class KvfoldQwen2MoeForCausalLM(Qwen2MoeForCausalLM):
    """vLLM's Qwen2-MoE on kvfold's attention backend (architecture ``KvfoldQwen2MoeForCausalLM``)."""


@on_kvfold_attention
class KvfoldQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """vLLM's Qwen3-MoE on kvfold's attention backend (architecture ``KvfoldQwen3MoeForCausalLM``)."""


@on_kvfold_attention
class KvfoldGraniteForCausalLM(GraniteForCausalLM):
    """vLLM's Granite on kvfold's attention backend (architecture ``KvfoldGraniteForCausalLM``);
    its logit scale (``attention_multiplier``) is kept with the layer's."""


@on_kvfold_attention
class KvfoldPhi3ForCausalLM(Phi3ForCausalLM):
    """vLLM's Phi-3 (Llama's model with one fused ``qkv_proj``) on kvfold's attention backend (architecture
    ``KvfoldPhi3ForCausalLM``)."""
