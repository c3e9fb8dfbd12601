"""The version of kvfold, written here only (``pyproject.toml`` reads it; ``kvfold --version`` prints it)."""

__version__ = "0.3.0"
