"""The KV space ``kvfold serve`` asks for: bytes a token, the weights, the free memory, the plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfold.integrations.vllm import settings
from kvfold.runtime.errors import UserError
from kvfold.runtime.models import resolve_spec

GIB = settings.GIB
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)


def test_a_token_of_smollm2_takes_46080_bytes():
    """30 layers × keys and values × 3 KV heads × 64 channels × 4 bytes: stock vLLM's (no widened head)."""
    assert settings.kv_bytes_per_token(SMOLLM2) == 30 * 2 * 3 * 64 * 4 == 46_080
    assert settings.kv_bytes_per_token(SMOLLM2, 2) == 23_040


def test_the_weights_are_counted_in_float32():
    model_dir, _ = resolve_spec("smollm2-135m")
    assert 530e6 < settings.weights_bytes(model_dir) < 545e6  # 134.5M parameters


def test_the_free_memory_is_read():
    assert 0 < settings.available_memory() < 1 << 50


def _plan(free: float, cache_tokens: int = 1699):
    return settings.plan_kv_space(
        per_token=57_600, max_model_len=8192, largest_cache_tokens=cache_tokens, weights=538_000_000, free=int(free)
    )


def test_the_plan_takes_a_share_of_what_is_left_between_a_full_context_and_the_cap():
    need = 57_600 * (8192 + 1728)  # whole blocks of 32
    server = 2 * 538_000_000 + settings.SERVER_BYTES
    assert _plan(22 * GIB).bytes == settings.KV_CAP  # a quarter of 17 GiB is past the cap
    assert _plan(8 * GIB).bytes == int(0.25 * (8 * GIB - server))
    assert _plan(server + need + 1).bytes == need  # a quarter of what is left is below one full context
    assert _plan(8 * GIB).need == need


def test_too_little_memory_is_one_line_with_the_flags_to_pass():
    with pytest.raises(UserError) as err:
        _plan(4 * GIB)
    message = str(err.value)
    assert "\n" not in message and "4.0 GiB of memory is free" in message
    assert "--max-model-len N" in message and "--kv-space N" in message


def test_the_head_widths_kvfold_serve_checks_are_vllms_cpu_attentions():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvfold.integrations.vllm.settings import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_the_engine_settings_name_each_familys_class_and_refuse_others():
    overrides = {kind: settings.engine_settings("/c", model_type=kind)["hf_overrides"] for kind in ("llama", "qwen3")}
    assert overrides == {
        "llama": {"architectures": ["KvfoldLlamaForCausalLM"]},
        "qwen3": {"architectures": ["KvfoldQwen3ForCausalLM"]},
    }
    with pytest.raises(
        UserError,
        match="qwen3_moe, granite, phi3 models; this one is 'gemma",
    ):
        settings.engine_settings("/c", model_type="gemma3")
