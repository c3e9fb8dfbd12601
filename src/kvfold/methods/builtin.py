"""Imports every method module of :mod:`kvfold.methods` so that their ``@register`` decorators run.

The family packages (:mod:`~kvfold.methods.eviction`, :mod:`~kvfold.methods.merging`,
:mod:`~kvfold.methods.compaction`) are walked whole; modules that define no method (the shared
mechanisms of :mod:`~kvfold.methods.core`, a method's helpers) register nothing.
"""

import importlib
import pkgutil

import kvfold.methods as _package

for _module in pkgutil.walk_packages(_package.__path__, prefix=f"{_package.__name__}."):
    importlib.import_module(_module.name)
