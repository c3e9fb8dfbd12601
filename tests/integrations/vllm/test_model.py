"""The plugin's model classes: every stock attention layer rebuilt on kvfold's backend, as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3Config
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention

from kvfold.integrations.vllm.backend import KvfoldAttentionBackend
from kvfold.integrations.vllm.model import use_kvfold_attention


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64).save_pretrained(directory)
    return directory


@pytest.fixture
def vllm_config(model_directory):
    """A config of its own for each test (its layers register their names in it)."""
    return VllmConfig(model_config=ModelConfig(model=str(model_directory), dtype="float32", tokenizer=None))


def _layers(config: VllmConfig, **extra) -> nn.Module:
    """Two decoder layers' worth of stock attention, as a vLLM model holds them (``self_attn.attn``)."""
    model = nn.ModuleList()
    for index, window in enumerate((None, 64)):
        owner = nn.Module()
        owner.attn = Attention(
            4,
            64,
            0.07,
            num_kv_heads=2,
            cache_config=config.cache_config,
            per_layer_sliding_window=window,
            prefix=f"model.layers.{index}.self_attn.attn",
            **extra,
        )
        model.append(owner)
    return model


def test_every_attention_layer_is_rebuilt_on_kvfolds_backend_as_it_was(vllm_config):
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = _layers(vllm_config)
        stock = [owner.attn for owner in model]
        assert all(layer.attn_backend is not KvfoldAttentionBackend for layer in stock)
        assert use_kvfold_attention(model) == 2
    context = vllm_config.compilation_config.static_forward_context
    for owner, before in zip(model, stock, strict=True):
        after = owner.attn
        assert after is not before and after.attn_backend is KvfoldAttentionBackend
        assert (after.num_heads, after.num_kv_heads, after.head_size) == (4, 2, 64)
        assert after.impl.scale == before.impl.scale == pytest.approx(0.07)
        assert after.sliding_window == before.sliding_window
        assert after.layer_name == before.layer_name and context[after.layer_name] is after
    assert [owner.attn.sliding_window for owner in model] == [None, 64]


def test_attention_kvfolds_kernel_does_not_compute_is_refused(vllm_config):
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = _layers(vllm_config, alibi_slopes=[0.5] * 4)
        with pytest.raises(ValueError, match="ALiBi, a logit soft cap or sinks"):
            use_kvfold_attention(model)


def test_every_served_familys_architecture_is_registered_with_its_class():
    from vllm import ModelRegistry

    from kvfold.integrations.vllm import model as served
    from kvfold.integrations.vllm import register
    from kvfold.integrations.vllm.settings import ARCHITECTURES

    register()
    supported = ModelRegistry.get_supported_archs()
    for model_type, architecture in ARCHITECTURES.items():
        cls = getattr(served, architecture)
        assert architecture in supported, model_type
        assert cls.__mro__[1].__name__ == architecture.removeprefix("Kvfold"), model_type  # vLLM's own class


@pytest.mark.parametrize("extra", [{"logits_soft_cap": 30.0}], ids=["soft-cap"])
def test_a_logit_soft_cap_is_refused_too(vllm_config, extra):
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        model = _layers(vllm_config, **extra)
        with pytest.raises(ValueError, match="ALiBi, a logit soft cap or sinks"):
            use_kvfold_attention(model)
