"""Compression methods: a registry of named, composable methods (see :mod:`kvfold.methods.core.spec`).

Importing this package registers every built-in method (:mod:`kvfold.methods.builtin`).
"""

from kvfold.methods import builtin  # noqa: F401 - registers the built-in methods
from kvfold.methods.core.base import (
    REGISTRY,
    ComposedMethod,
    Folder,
    Method,
    Selector,
    Standalone,
    Wrapper,
    available_methods,
    build_method,
    register,
)
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.spec import SpecError, parse_spec, split_specs
from kvfold.runtime.defaults import RECOMMENDED  # written there: the command line reads it without torch

__all__ = [
    "RECOMMENDED",
    "REGISTRY",
    "ComposedMethod",
    "CompressionContext",
    "Folder",
    "Method",
    "Selector",
    "SpecError",
    "Standalone",
    "Wrapper",
    "available_methods",
    "build_method",
    "parse_spec",
    "register",
    "split_specs",
]
