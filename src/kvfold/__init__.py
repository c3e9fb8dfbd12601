"""kvfold: training-free KV-cache merging and compaction on Hugging Face transformers.

Importing kvfold changes nothing in transformers: :func:`load_model` (or :func:`prepare_model`
for a model you loaded yourself, or :func:`enable`) switches a model to the kvfold attention.
"""

from kvfold.methods import available_methods, build_method, split_specs
from kvfold.pipeline.context import CompressedContext, PrefilledContext, build_prompt, prefill
from kvfold.runtime.attention import enable
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache, FoldedLayer
from kvfold.runtime.models import load_model, prepare_model
from kvfold.store.format import CacheFileError
from kvfold.store.load import load_cache, load_context

__version__ = "0.1.0"

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
    "load_context",
    "load_model",
    "prefill",
    "prepare_model",
    "split_specs",
    "__version__",
]
