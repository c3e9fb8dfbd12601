"""Options the registered Attention Matching methods share: the variants of :mod:`.method` and the
``am_fit`` folder of :mod:`.fit_folder`.

Zweiger et al. 2026 (``papers/attention-matching.md``): the cap on reference queries per KV head
and the ``random`` source's default count (§3.1, App. D), and the check of the fit's options that
depart from the paper's plain fit (§3.2): the mass residual's weighting and the value ridge.
"""

from __future__ import annotations

import sys

from kvfold.methods.core.spec import SpecError

RANDOM_QUERIES = 4096
"""Queries per KV head of the ``random`` source when ``max_queries`` is None (all)."""
MASS_WEIGHTS = ("none", "relative")
"""The ``mass_weight`` options: how the queries are weighted in the mass fit (see ``FitConfig``)."""


def query_cap(max_queries: int | None) -> int:
    """The cap of reference queries per KV head: ``max_queries``, or no cap for None."""
    return sys.maxsize if max_queries is None else max_queries


def check_fit_options(name: str, mass_weight: str, value_ridge: float | None) -> None:
    """Raise :class:`~kvfold.methods.core.spec.SpecError` unless ``mass_weight`` is one of
    :data:`MASS_WEIGHTS` and ``value_ridge`` is None or positive (``name``: the method, for the message)."""
    if mass_weight not in MASS_WEIGHTS:
        raise SpecError(f"{name}: mass_weight must be one of {', '.join(MASS_WEIGHTS)}; got {mass_weight!r}")
    if value_ridge is not None and not value_ridge > 0:
        raise SpecError(f"{name}: value_ridge must be > 0 (or none); got {value_ridge}")
