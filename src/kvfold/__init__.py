"""kvfold: training-free KV-cache merging and compaction on Hugging Face transformers.

Importing kvfold changes nothing in transformers: :func:`load_model` (or :func:`prepare_model`
for a model you loaded yourself, or :func:`enable`) switches a model to the kvfold attention.
A compressed context goes to a file with :func:`save_context` and comes back with
:func:`load_context` (a raw cache: :func:`save_cache`, :func:`load_cache`; a chat: :func:`save_chat`,
:func:`load_chat`).
"""

from kvfold.methods import available_methods, build_method, split_specs
from kvfold.pipeline.context import CompressedContext, PrefilledContext, build_prompt, prefill
from kvfold.runtime.attention import enable
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache, FoldedLayer
from kvfold.runtime.models import load_model, prepare_model
from kvfold.store.chat import load_chat, save_chat
from kvfold.store.format import CacheFileError
from kvfold.store.load import load_cache, load_context
from kvfold.store.save import save_cache, save_context

__version__ = "0.2.0"

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
    "__version__",
]
