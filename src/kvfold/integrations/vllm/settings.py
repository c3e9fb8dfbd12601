"""The vLLM settings that serve kvfold caches: the architecture name, the connector's configuration keys
and :func:`engine_settings` (imports neither vLLM nor torch)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "KvfoldLlamaForCausalLM"
"""The architecture name under which the β-carrying Llama is registered with vLLM."""
SERVED_MODEL_TYPES = ("llama",)
"""Model families the plugin serves (its model class is vLLM's Llama)."""
EXTRA_CACHES = "kvfold_caches"
"""``kv_connector_extra_config`` key: the folder of cache files."""
EXTRA_SHIFT = "kvfold_keep_positions"
"""``kv_connector_extra_config`` key (default True): turn keys to the served positions (False only to
show that answers depend on it)."""
BLOCK_SIZE = 32
"""Tokens per KV block (vLLM's CPU attention takes multiples of 32; its default 128 pads more)."""


def engine_settings(caches: str, *, keep_positions: bool = True, prefix_caching: bool = True) -> dict[str, Any]:
    """The vLLM engine arguments that serve kvfold caches from folder ``caches`` (``vllm.LLM(**...)`` or
    ``AsyncEngineArgs``): the β-carrying architecture, float32, the connector, prefix caching salted
    per file. ``keep_positions=False`` exists for a test that shows the key rotation matters."""
    return {
        "hf_overrides": {"architectures": [ARCHITECTURE]},
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": prefix_caching,
        "kv_transfer_config": {
            "kv_connector": "KvfoldConnector",
            "kv_connector_module_path": "kvfold.integrations.vllm.connector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {EXTRA_CACHES: str(caches), EXTRA_SHIFT: keep_positions},
        },
    }
