"""Compression methods: a registry of named, composable methods (see :mod:`kvfold.methods.core.spec`)."""

from kvfold.methods.core.base import (
    REGISTRY,
    ComposedMethod,
    CompressionContext,
    Folder,
    Method,
    Selector,
    Standalone,
    Wrapper,
    available_methods,
    build_method,
    register,
)
from kvfold.methods.core.spec import SpecError, parse_spec, split_specs

__all__ = [
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
