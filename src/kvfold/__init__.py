"""kvfold: training-free KV-cache merging and compaction on Hugging Face transformers.

Importing kvfold changes nothing in transformers: :func:`load_model` (or :func:`prepare_model`
for a model you loaded yourself, or :func:`enable`) switches a model to the kvfold attention.
A compressed context goes to a file with :func:`save_context` and comes back with
:func:`load_context` (a raw cache: :func:`save_cache`, :func:`load_cache`; a chat: :func:`save_chat`,
:func:`load_chat`).

The names below are imported on first use, so that ``import kvfold`` (and ``kvfold --help``)
loads no torch until a name that needs it is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvfold.runtime.version import __version__

_EXPORTS = {
    "Budget": "kvfold.runtime.budget",
    "CacheFileError": "kvfold.store.format",
    "CompressedContext": "kvfold.pipeline.context",
    "FoldedCache": "kvfold.runtime.cache",
    "FoldedLayer": "kvfold.runtime.folded_layer",
    "PrefilledContext": "kvfold.pipeline.context",
    "available_methods": "kvfold.methods",
    "build_method": "kvfold.methods",
    "build_prompt": "kvfold.pipeline.context",
    "enable": "kvfold.runtime.attention",
    "load_cache": "kvfold.store.load",
    "load_chat": "kvfold.store.chat",
    "load_context": "kvfold.store.load",
    "load_model": "kvfold.runtime.models",
    "prefill": "kvfold.pipeline.context",
    "prepare_model": "kvfold.runtime.models",
    "save_cache": "kvfold.store.save",
    "save_chat": "kvfold.store.chat",
    "save_context": "kvfold.store.save",
    "split_specs": "kvfold.methods",
    "UserError": "kvfold.runtime.errors",
}
"""Each public name and the module it lives in."""

__all__ = [
    "Budget",
    "CacheFileError",
    "CompressedContext",
    "FoldedCache",
    "FoldedLayer",
    "PrefilledContext",
    "available_methods",
    "build_method",
    "build_prompt",
    "enable",
    "load_cache",
    "load_chat",
    "load_context",
    "load_model",
    "prefill",
    "prepare_model",
    "save_cache",
    "save_chat",
    "save_context",
    "split_specs",
    "UserError",
    "__version__",
]

if TYPE_CHECKING:  # what static tools see; at run time :func:`__getattr__` imports on demand
    from kvfold.methods import available_methods, build_method, split_specs
    from kvfold.pipeline.context import CompressedContext, PrefilledContext, build_prompt, prefill
    from kvfold.runtime.attention import enable
    from kvfold.runtime.budget import Budget
    from kvfold.runtime.cache import FoldedCache
    from kvfold.runtime.errors import UserError
    from kvfold.runtime.folded_layer import FoldedLayer
    from kvfold.runtime.models import load_model, prepare_model
    from kvfold.store.chat import load_chat, save_chat
    from kvfold.store.format import CacheFileError
    from kvfold.store.load import load_cache, load_context
    from kvfold.store.save import save_cache, save_context


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfold' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
