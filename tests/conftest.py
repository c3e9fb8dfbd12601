"""Shared fixtures: tiny random models of every supported family, and the embedded SmolLM2."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("vllm") is None:
    # Set before transformers imports Triton: kvfold's Triton kernel runs interpreted on the CPU
    # (tests/runtime/test_triton_attention.py). Not in vLLM's environment, whose engines share it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import (  # noqa: E402 - after the line above
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

collect_ignore = [] if importlib.util.find_spec("vllm") else ["integrations/vllm"]
"""The vLLM tests run in vLLM's own environment (``make test`` runs them there, after this suite)."""

TINY = dict(
    vocab_size=97,
    hidden_size=96,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    head_dim=16,
)

MOE = {"num_experts_per_tok": 2, "experts_implementation": "eager"}
QWEN_MOE = {"num_experts": 4, "moe_intermediate_size": 32}

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False}),
    # Mixture-of-experts: the attention of the dense families; experts looped in eager code, which takes
    # float64 (transformers' grouped products do not).
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"sliding_window": None, **MOE, "num_local_experts": 4}),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {"use_sliding_window": False, **MOE, **QWEN_MOE, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"use_sliding_window": False, **MOE, **QWEN_MOE}),
    # OLMo 2: query and key norms over all heads at once; Granite: its own logit scale and multipliers.
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        {"attention_multiplier": 0.3, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0},
    ),
    # Phi-3: one fused qkv_proj.
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma3: sliding-window layers stay as transformers keeps them; global layers are folded.
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    ),
}


def make_tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of one supported family, in eval mode, float32, stock attention."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    return model_cls(config).eval()


@pytest.fixture(params=sorted(FAMILIES))
def tiny_family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (converted once and cached); skipped if not installed."""
    from kvfold.runtime.models import ModelLoadError, load_model

    try:
        return load_model("smollm2-135m")
    except ModelLoadError as err:  # pragma: no cover - make install provides it
        pytest.skip(str(err))


class CharTokenizer:
    """A tiny offline tokenizer for tests on random models: one id per character, no chat template."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [1] if add_special_tokens else []
        ids += [(ord(c) % 90) + 2 for c in text]
        return type("Encoding", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 30) for i in ids)

    def convert_tokens_to_ids(self, token: str):
        return None
