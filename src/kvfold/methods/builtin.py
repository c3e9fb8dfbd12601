"""Imports every built-in method module so that their ``@register`` decorators run."""

from kvfold.methods import plumbing  # noqa: F401
