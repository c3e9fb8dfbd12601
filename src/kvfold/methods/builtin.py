"""Imports every method module of :mod:`kvfold.methods` so that their ``@register`` decorators run.

Modules that define no method (the grammar, the base classes, scoring and budget helpers) are
imported too; importing them registers nothing.
"""

import importlib
import pkgutil

import kvfold.methods as _package

for _module in pkgutil.iter_modules(_package.__path__):
    importlib.import_module(f"{_package.__name__}.{_module.name}")
