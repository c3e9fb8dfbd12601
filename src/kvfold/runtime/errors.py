"""The one exception type for bad input: what a user gave that kvfold refuses.

:class:`UserError` marks an error whose message is meant for the person who ran the command: a
spec that does not parse, a budget out of range, a damaged cache file, a file that does not exist.
The command line (:func:`kvfold.cli.main.main`) prints such an error as one line and exits with 2;
any other exception is a fault of kvfold's own and is reported as an internal error (exit 1, the
traceback with ``--debug``).

It subclasses :class:`ValueError`, so code that catches ``ValueError`` around kvfold's calls
keeps catching every user error. This module imports nothing: every layer of kvfold may raise it.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input, explained in one line that says what was wrong and what to give instead.

    Every user-facing error class of kvfold derives from it (``SpecError``, ``CacheFileError``,
    ``QuantSpecError``, ``ModelLoadError``, …); raise it directly for a plain refusal of an argument.
    """
