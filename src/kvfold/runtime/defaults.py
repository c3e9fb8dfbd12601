"""The defaults every entry point shares, in a module that imports nothing heavy.

The command line shows them in ``--help`` before torch is imported; the Python API
(:meth:`kvfold.PrefilledContext.compress`, :class:`kvfold.pipeline.chat.ChatSession`,
:func:`kvfold.load_model`) takes the same values from here.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVFOLD_CACHE"
"""The folder kvfold keeps what it makes once per machine: converted models and compiled kernels."""

RECOMMENDED = "kvzip+am_fit"
"""The pipeline recommended for query-agnostic compaction: the default method of ``kvfold generate``,
``kvfold compress``, ``kvfold chat``, ``kvfold bench``, :meth:`kvfold.PrefilledContext.compress` and
:class:`kvfold.pipeline.chat.ChatSession`, and what ``kvfold demo`` shows beside the full cache,
``kvzip`` and ``leverage``. The one place to change when measurements pick another
(re-exported as :data:`kvfold.methods.RECOMMENDED`)."""

DEFAULT_BUDGET = 0.1
"""The fraction of the context kept when no budget is given (a tenth of the cache)."""

DEFAULT_MODEL = "smollm2-135m"
"""The embedded SmolLM2-135M-Instruct (8,192 positions)."""

DEFAULT_LENGTH = 2048
"""Context tokens of a synthetic context when no ``--length`` is given."""

DEFAULT_CHAT_BUDGET = 512
"""Entries per KV head a conversation keeps after a compaction when no budget is given
(:class:`kvfold.pipeline.chat.ChatSession`, ``kvfold chat``)."""


def cache_root() -> Path:
    """Where kvfold keeps what it makes once per machine (converted GGUF models under ``converted/``,
    compiled kernels under ``kernels/``): ``$KVFOLD_CACHE``, else ``$XDG_CACHE_HOME/kvfold``, else
    ``~/.cache/kvfold``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfold"
    )
    return Path(root)
