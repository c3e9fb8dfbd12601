"""kvfold caches served by vLLM (0.32, CPU): ``pip install 'kvfold[vllm]'``, then ``kvfold serve``.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins`` entry point; it
only registers the model architecture ``KvfoldLlamaForCausalLM`` (nothing changes for a server that
does not ask for it). ``kvfold serve`` starts vLLM's OpenAI server with :func:`engine_settings`:

* :mod:`.model` — Llama with heads widened by one channel that carries β (the stock CPU kernel then
  adds β to the logits);
* :mod:`.layout` — a cache file laid out for vLLM: one length for every row (padding with β that
  receives no attention), keys turned to the served positions;
* :mod:`.connector` — the KV connector that loads the file's entries into the request's blocks;
* :mod:`.requests` — which caches a folder holds, their checks, the prompt that continues a cache as
  ``kvfold ask`` does;
* :mod:`.server` — the middleware that lists the caches and rewrites chat requests naming one.

Importing this package imports neither vLLM nor torch.
"""

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


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register :data:`ARCHITECTURE` with vLLM's model registry."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "kvfold.integrations.vllm.model:KvfoldLlamaForCausalLM")


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
