"""kvfold caches served by vLLM (0.32, CPU): ``pip install 'kvfold[vllm]'``, then ``kvfold serve``.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins`` entry point; it
only registers the model architectures of :data:`~kvfold.integrations.vllm.settings.ARCHITECTURES`
(``KvfoldLlamaForCausalLM``, ``KvfoldQwen3ForCausalLM``, …; nothing changes for a server that does
not ask for one). ``kvfold serve`` starts vLLM's OpenAI server with
:func:`~kvfold.integrations.vllm.settings.engine_settings`:

* :mod:`.model` — vLLM's model classes of the served families, their attention layers on kvfold's backend;
* :mod:`.backend` — the attention backend: vLLM's ``CPU_ATTN`` for every request, kvfold's attention
  over the file's rows for requests on a cache file;
* :mod:`.layout` — what is served, and the RoPE turn that puts the question at the context's positions;
* :mod:`.pool_layout` — a cache file laid out in a request's blocks at its own bytes (its rows packed
  into chunks of one block of one layer, every layer's blocks one pool);
* :mod:`.connector` — the KV connector that writes the file's chunks into the request's blocks;
* :mod:`.requests` — which caches a folder holds, their checks, the prompt that continues a cache as
  ``kvfold ask`` does;
* :mod:`.server` — the middleware that lists the caches and rewrites chat requests naming one;
* :mod:`.settings` — the engine arguments (:func:`~kvfold.integrations.vllm.settings.engine_settings`).

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

from kvfold.integrations.vllm.settings import ARCHITECTURES, BLOCK_SIZE, engine_settings

__all__ = ["ARCHITECTURES", "BLOCK_SIZE", "engine_settings", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register :data:`ARCHITECTURES` with vLLM's model registry
    (each name is its class's in :mod:`kvfold.integrations.vllm.model`)."""
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for architecture in ARCHITECTURES.values():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, f"kvfold.integrations.vllm.model:{architecture}")
