"""kvfold.runtime.errors: one type for bad input, from which every user-facing error class derives."""

from __future__ import annotations

import importlib

import pytest

from kvfold.runtime.errors import UserError

USER_ERRORS = [
    ("kvfold.methods.core.spec", "SpecError"),
    ("kvfold.runtime.quant_config", "QuantSpecError"),
    ("kvfold.runtime.quantized_checks", "QuantizedTensorsError"),
    ("kvfold.runtime.models", "ModelLoadError"),
    ("kvfold.store.format", "CacheFileError"),
    ("kvfold.store.format", "CorruptCacheFileError"),
    ("kvfold.store.format", "CacheFileVersionError"),
    ("kvfold.store.format", "ModelMismatchError"),
    ("kvfold.store.format", "DtypeDeviceError"),
    ("kvfold.evaluate.running.distributed", "RayUnavailableError"),
    ("kvfold.integrations.vllm.requests", "CacheRequestError"),
    ("kvfold.integrations.vllm.layout", "UnservableCacheError"),
]


@pytest.mark.parametrize("module,name", USER_ERRORS)
def test_every_user_facing_error_is_a_user_error_and_still_a_value_error(module, name):
    error = getattr(importlib.import_module(module), name)
    assert issubclass(error, UserError) and issubclass(error, ValueError)


def test_a_model_that_cannot_load_is_still_a_runtime_error_and_a_failed_write_an_os_error():
    from kvfold.runtime.files import OutputError
    from kvfold.runtime.models import ModelLoadError

    assert issubclass(ModelLoadError, RuntimeError)
    assert issubclass(OutputError, OSError) and not issubclass(OutputError, UserError)


def test_the_package_exports_it():
    import kvfold

    assert kvfold.UserError is UserError
