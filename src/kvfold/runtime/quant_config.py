"""The formats a folded cache's entries are stored in: :class:`QuantConfig`, its options, and the
bytes an entry holds in it.

A format is ``int8``, ``int4``, ``int3``, ``int2`` (KIVI's scheme, Liu et al. 2024, *KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache*, §3: keys per channel over groups of
``key_group`` entries of a row, values per entry over groups of ``value_group`` channels, float16
scales and zero points) or ``fp8`` (e4m3 with one float32 scale a row), with options written in
brackets (``int4[key_group=64,outliers=2]``): :meth:`QuantConfig.parse` reads that text and
:meth:`QuantConfig.describe` writes it back. :mod:`kvfold.runtime.quantize` stores entries in a
format; this module only describes it (nothing here quantizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from kvfold.runtime.errors import UserError

SIXTEEN_BIT = 2
"""Bytes of an unquantized element as a GPU user holds it (bf16 / fp16)."""


class QuantSpecError(UserError):
    """A quantization format or option that does not exist."""


@dataclass(frozen=True)
class QuantConfig:
    """How a folded cache's entries are stored.

    Attributes:
        format: ``int8``, ``int4``, ``int3``, ``int2`` or ``fp8``.
        key_group: entries of a row per key group (each channel of a group shares a scale and a zero
            point; KIVI's group size, 32).
        value_group: channels per value group of an entry (0: the whole head, one scale and zero
            point per entry).
        outliers: entries per row kept in full precision: those whose key lies farthest outside its
            row's per-channel range (the attention sinks and the first tokens, whose keys widen a
            group's range for every entry in it).
        clip: 1 to search each group's range (a key channel over its group of entries, a value
            group of an entry) for the one that gives the group back with the least squared error:
            its min–max range shrunk toward its middle by a factor of
            :data:`~kvfold.runtime.quant_grid.CLIP_FACTORS`, the values outside clamped to the end
            codes (the clipping search of weight quantizers, e.g. AWQ, Lin et al. 2024 §3.2); 0:
            min–max. The stored tensors are the same either way.
        wide: 8 or 16 (the model's dtype, unquantized): the storage of a layer whose rows hold on
            average at most one key group (``key_group`` entries), see :meth:`layer_format`; 0:
            every layer in ``format``.
        rotate: 1 to store every value rotated by a fixed randomized Hadamard matrix
            (:mod:`kvfold.runtime.value_rotation`): its size spread evenly over its channels before
            the codes; attention rotates the stored part's weighted values back. The value dimension
            must be a power of two. 0: values coded as they are.
    """

    format: str = "int4"
    key_group: int = 32
    value_group: int = 0
    outliers: int = 0
    clip: int = 0
    wide: int = 0
    rotate: int = 0

    FORMATS: ClassVar[tuple[str, ...]] = ("int8", "int4", "int3", "int2", "fp8")

    def __post_init__(self) -> None:
        if self.format not in self.FORMATS:
            raise QuantSpecError(f"unknown KV format {self.format!r}; use one of {', '.join(self.FORMATS)}")
        if self.key_group < 1 or self.value_group < 0 or self.outliers < 0:
            raise QuantSpecError("key_group must be ≥ 1, value_group and outliers ≥ 0")
        if self.clip not in (0, 1):
            raise QuantSpecError(f"clip is 0 (min–max ranges) or 1 (searched ranges); got {self.clip}")
        if self.rotate not in (0, 1):
            raise QuantSpecError(f"rotate is 0 (values coded as they are) or 1 (rotated first); got {self.rotate}")
        if self.clip and self.is_float:
            raise QuantSpecError("clip applies to the integer formats: fp8 has no ranges to search")
        if self.wide not in (0, 8, 16) or (self.wide and (self.is_float or self.wide <= self.bits)):
            raise QuantSpecError(
                f"wide is 8 or 16 bits, wider than an integer format's own; got wide={self.wide} for {self.format}"
            )

    @property
    def bits(self) -> int:
        """Bits per stored element (8 for fp8)."""
        return 8 if self.format == "fp8" else int(self.format[3:])

    @property
    def is_float(self) -> bool:
        return self.format == "fp8"

    @classmethod
    def parse(cls, text: str | int | None) -> QuantConfig | None:
        """``"int4"``, ``"4"``, ``4``, ``"fp8"``, ``"int4[key_group=64,outliers=2]"``; ``"16"``/``"none"``
        /None mean no quantization.

        Raises:
            QuantSpecError: an unknown format or option, naming what is valid.
        """
        if text is None:
            return None
        text = str(text).strip().lower()
        options: dict[str, int] = {}
        if "[" in text:
            if not text.endswith("]"):
                raise QuantSpecError(f"{text!r}: options go in brackets at the end, e.g. int4[key_group=32]")
            text, body = text[:-1].split("[", 1)
            names = {f.name for f in fields(cls)} - {"format"}
            for item in filter(None, (p.strip() for p in body.split(","))):
                key, sep, value = item.partition("=")
                if not sep or key.strip() not in names:
                    raise QuantSpecError(f"{item!r}: KV format options are {', '.join(sorted(names))} (key=value)")
                try:
                    options[key.strip()] = int(value)
                except ValueError:
                    raise QuantSpecError(f"{item!r}: {key.strip()} takes a whole number") from None
        if text in ("16", "32", "none", "full", "bf16", "fp16", "fp32"):
            if options:
                raise QuantSpecError(f"{text!r} is unquantized and takes no options")
            return None
        if text.isdigit():
            text = f"int{text}"
        return cls(format=text, **options)

    def describe(self) -> str:
        """The canonical text (``int4``, ``int4[key_group=64]``) that :meth:`parse` reads back."""
        defaults = QuantConfig(format=self.format)
        names = [f.name for f in fields(self) if f.name != "format"]
        extra = [f"{n}={getattr(self, n)}" for n in names if getattr(self, n) != getattr(defaults, n)]
        return self.format + (f"[{','.join(extra)}]" if extra else "")

    def layer_format(self, lengths: torch.Tensor) -> QuantConfig | None:
        """The storage of one layer whose rows hold ``lengths`` entries: this format, or with ``wide``
        and rows of on average at most one key group, ``wide`` bits (None for 16: the model's dtype).

        A row that short pays a whole key group's scales and zero points (``4·D`` bytes) for its few
        entries, and each of its entries carries a large share of its layer's attention, so its codes'
        rounding moves the layer's output most; a wider storage costs few bytes there. Under KVzip's
        global ranking at the smallest budgets most layers keep a handful of entries a row while a few
        keep hundreds (docs/memory.md, "Layers that keep few entries").
        """
        plain = replace(self, wide=0)
        if not self.wide or float(lengths.float().mean()) > self.key_group:
            return plain
        return None if self.wide == 16 else replace(plain, format=f"int{self.wide}")

    def entry_bytes(self, head_dim: int, value_dim: int | None = None, log_mass: bool = True) -> float:
        """Bytes one entry of one row holds, on average (codes, scales, zero points, β): the closed
        form :meth:`~kvfold.runtime.quantize.QuantizedRows.nbytes` adds up (its groups rounded up per
        row)."""
        value_dim = head_dim if value_dim is None else value_dim
        codes = (head_dim + value_dim) * self.bits / 8
        if self.is_float:
            scales = 0.0
        else:
            groups = math.ceil(value_dim / (self.value_group or value_dim))
            scales = 2 * SIXTEEN_BIT * (head_dim / self.key_group + groups)
        return codes + scales + (4 if log_mass else 0)
