"""The version of kvfold, written here only (``pyproject.toml`` reads it, ``kvfold.__version__`` and
``kvfold --version`` show it)."""

__version__ = "0.3.0"
