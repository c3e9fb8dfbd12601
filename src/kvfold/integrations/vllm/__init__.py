"""kvfold caches served by vLLM (0.32, CPU): ``pip install 'kvfold[vllm]'``, then ``kvfold serve``.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins`` entry point; it
only registers the model architecture ``KvfoldLlamaForCausalLM`` (nothing changes for a server that
does not ask for it). ``kvfold serve`` starts vLLM's OpenAI server with
:func:`~kvfold.integrations.vllm.settings.engine_settings`:

* :mod:`.model` — Llama with heads widened by one channel that carries β (the stock CPU kernel then
  adds β to the logits);
* :mod:`.layout` — a cache file laid out for vLLM: one length for every row (padding with β that
  receives no attention), keys turned to the served positions;
* :mod:`.connector` — the KV connector that loads the file's entries into the request's blocks;
* :mod:`.requests` — which caches a folder holds, their checks, the prompt that continues a cache as
  ``kvfold ask`` does;
* :mod:`.server` — the middleware that lists the caches and rewrites chat requests naming one;
* :mod:`.settings` — the engine arguments (:func:`~kvfold.integrations.vllm.settings.engine_settings`).

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

from kvfold.integrations.vllm.settings import ARCHITECTURE, BLOCK_SIZE, POOL_ARCHITECTURE, engine_settings

__all__ = ["ARCHITECTURE", "BLOCK_SIZE", "POOL_ARCHITECTURE", "engine_settings", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register :data:`ARCHITECTURE` with vLLM's model registry."""
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    if ARCHITECTURE not in supported:
        ModelRegistry.register_model(ARCHITECTURE, "kvfold.integrations.vllm.model:KvfoldLlamaForCausalLM")
    if POOL_ARCHITECTURE not in supported:
        ModelRegistry.register_model(POOL_ARCHITECTURE, "kvfold.integrations.vllm.model:KvfoldPoolLlamaForCausalLM")
