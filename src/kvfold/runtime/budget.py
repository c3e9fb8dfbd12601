"""Cache budgets: a fraction of the context to keep, or a token count."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfold.runtime.errors import UserError


@dataclass(frozen=True)
class Budget:
    """How much of a context the compressed cache keeps, per KV head and layer on average.

    Attributes:
        fraction: a fraction in (0, 1] of the context's tokens (``0.1`` = "10% cache budget").
        tokens: an absolute number of entries (≥ 1), used when ``fraction`` is None.
    """

    fraction: float | None = None
    tokens: int | None = None
    memory: float | None = None
    """A memory budget instead: the fraction in (0, 1] of the full cache's bytes at 16 bits that
    the compressed cache may hold (:func:`kvfold.pipeline.memory.plan_memory` turns it into a number of
    tokens and a precision)."""

    @classmethod
    def of_memory(cls, value: float | str) -> Budget:
        """A memory budget: ``0.0625`` = a sixteenth of the 16-bit full cache's bytes.

        Raises:
            UserError: anything but a fraction in (0, 1].
        """
        try:
            number = float(str(value).strip())
        except ValueError:
            number = math.nan
        if not 0.0 < number <= 1.0:
            raise UserError(f"a memory budget is a fraction in (0, 1] of the 16-bit cache's bytes; got {value!r}")
        return cls(memory=number)

    @classmethod
    def parse(cls, value: float | int | str | Budget) -> Budget:
        """Read ``0.1`` / ``"0.1"`` (a fraction) or ``512`` / ``"512"`` (a token count).

        ``1`` and ``1.0`` mean the whole context. A value with a decimal point is a fraction.

        Raises:
            UserError: anything else, with what is accepted.
        """
        if isinstance(value, Budget):
            return value
        text = str(value).strip()
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        is_integer_text = text.isdigit()
        if isinstance(value, bool) or math.isnan(number):
            raise UserError(f"budget must be a fraction in (0, 1] or a positive token count; got {value!r}")
        if is_integer_text or (isinstance(value, int) and not isinstance(value, bool)):
            count = int(number)
            if count == 1:
                return cls(fraction=1.0)
            if count >= 2:
                return cls(tokens=count)
        elif 0.0 < number <= 1.0:
            return cls(fraction=number)
        raise UserError(f"budget must be a fraction in (0, 1] or a positive token count; got {value!r}")

    def count(self, context_tokens: int) -> int:
        """Entries to keep for a context of ``context_tokens`` tokens (at least 1, at most all)."""
        if context_tokens <= 0:
            raise ValueError("cannot apply a budget to an empty context")
        if self.memory is not None:
            raise ValueError("a memory budget is turned into a token budget first (kvfold.pipeline.memory)")
        if self.fraction is not None:
            return max(1, min(context_tokens, math.ceil(self.fraction * context_tokens - 1e-9)))
        return max(1, min(context_tokens, int(self.tokens)))

    def counts(self, context_lengths: torch.Tensor) -> torch.Tensor:
        """Per batch row counts for contexts of the given lengths, ``(B,)`` long."""
        return torch.tensor([self.count(int(n)) for n in context_lengths.tolist()], dtype=torch.long)

    @property
    def is_full(self) -> bool:
        return (self.fraction is not None and self.fraction >= 1.0) or (self.memory is not None and self.memory >= 1.0)

    def label(self) -> float | int:
        """The value as written in result files: the fraction, or the token count."""
        if self.memory is not None:
            return self.memory
        return self.fraction if self.fraction is not None else int(self.tokens)

    def __str__(self) -> str:
        return str(self.label())
