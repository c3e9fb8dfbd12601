"""Method base classes, the registry and composition of specs into runnable methods.

A method is three swappable decisions (architecture guide): **scores / selection** (a
:class:`Selector`), **budget allocation** (the selector's layer budgets, redistributed by
:class:`Wrapper` prefixes such as ``adakv:``) and **folding** (a :class:`Folder` after ``+``;
plain eviction by default). Methods that do all three their own way are :class:`Standalone`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.spec import Component, ParsedSpec, SpecError, parse_spec
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quant_config import QuantConfig, QuantSpecError
from kvfold.runtime.rows import NEG_INF

# ------------------------------------------------------------------------- options


def _coerce(value: str, annotation: Any, owner: str, key: str) -> Any:
    target = annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value.lower() == "none":
            return None
        target = args[0]
    try:
        if target is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if target is int:
            number = float(value)
            if number != int(number):
                raise ValueError(value)
            return int(number)
        if target is float:
            return float(value)
        return target(value)
    except (TypeError, ValueError):
        name = getattr(target, "__name__", str(target))
        raise SpecError(f"{owner}: option {key}={value!r} must be a {name}") from None


class Method:
    """Base of every registered method. Subclasses are dataclasses whose fields are options."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    role: ClassVar[str] = "standalone"
    query_window: ClassVar[int] = 0
    """How many of the last prefill query states the method reads (captured during prefill)."""
    uses_repeat_pass: ClassVar[bool] = False
    """True when compression runs the repeat pass over the prefilled cache
    (:mod:`kvfold.methods.core.repeat`; ``kvfold bench`` then times that pass alone too)."""
    fits_by_attention_matching: ClassVar[bool] = False
    """True when compression fits β and values by Attention Matching's least squares (``kvfold bench`` then
    records how the fits' logits are multiplied, :func:`kvfold.runtime.exact_products.products_path`)."""

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []

    @classmethod
    def from_options(cls, options: dict[str, str]) -> Method:
        """Build with options given as text (from a spec); unknown options are errors."""
        valid = cls.option_names()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            hint = ", ".join(valid) if valid else "none"
            raise SpecError(f"{cls.name}: unknown option(s) {', '.join(unknown)}; valid options: {hint}")
        hints = typing.get_type_hints(cls) if valid else {}
        values = {k: _coerce(v, hints[k], cls.name, k) for k, v in options.items()}
        method = cls(**values)
        method.validate()
        return method

    def validate(self) -> None:
        """Check option values; raise ``SpecError`` with what is allowed."""

    def describe_options(self) -> dict[str, Any]:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    def prepare(self, ctx: CompressionContext) -> None:
        """Called once per compression before any layer is edited (e.g. an extra scoring pass)."""

    def repeat_records(self, ctx: CompressionContext | None = None) -> frozenset[str]:
        """What this method reads from the repeat pass (:data:`kvfold.methods.core.repeat.RECORDS`:
        KVzip's scores, the queries of Attention Matching); empty for methods that do not run it.
        The first pass over a context records what every part of the method reads. With ``ctx``,
        what it reads on that context (``kvzip[scope=auto]`` depends on the context's length)."""
        return frozenset()

    def prefill_observers(self) -> list:
        """Observers the prefill should run for this method (see ``FoldedCache.prefill_observers``).

        Each has a ``key`` (its ``layer.entry_stats`` entry); a method must still work when the
        prefill ran without them (by recomputing what it needs in :meth:`prepare`).
        """
        return []


class Standalone(Method):
    """A method that compresses the whole cache its own way."""

    role: ClassVar[str] = "standalone"

    def compress(self, ctx: CompressionContext) -> None:
        raise NotImplementedError

    def online_policy(self, ctx: CompressionContext):
        """A policy that keeps the budget during decoding, or None (one-shot only)."""
        return None


class Allocator(Method):
    """A part that may spread a layer's budget over its KV heads (selectors and wrappers)."""

    def allocate(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        scores: torch.Tensor,
        counts: torch.Tensor,
        protected: torch.Tensor | None,
        ctx: CompressionContext,
    ) -> torch.Tensor:
        """Per-head counts ``(B, H)`` from ``counts`` ``(B, H)`` (uniform for the selector, which
        allocates first; then each wrapper, innermost first); unchanged by default."""
        return counts

    def plan(self, method: ComposedMethod, budgets: list[torch.Tensor], ctx: CompressionContext) -> list[torch.Tensor]:
        """Revise the layer budgets before any layer is compressed, seeing every layer (e.g. one
        ranking over all layers: ``global:``); called for each wrapper, innermost first.

        Each budget is ``(B,)`` (entries per head of the layer) or ``(B, H)`` (per head); a layer is
        left untouched when every head's budget reaches its valid entries.
        ``method.layer_scores(layer_idx, layer, ctx)`` gives a layer's final scores (computed once
        per compression). Unchanged by default.
        """
        return budgets


class Selector(Allocator):
    """Scores entries; the highest-scored (plus protected ones) are kept."""

    role: ClassVar[str] = "selector"
    comparable_scores: ClassVar[bool] = False
    """True when scores are on one scale in every layer (attention probabilities: SnapKV, KVzip,
    H2O, TOVA), so a ranking over all layers (``global:``) may compare them as they are; False
    (key norms, leverage, …): ``global:`` standardises each layer first."""
    query_agnostic: ClassVar[bool] = False
    """True when the scores read nothing of the prefill's own last queries (KVzip's repeat pass, key
    norms, positions, chance): a folder after it then fits on query-agnostic reference queries too
    (``kvzip+am_fit`` fits on the repeat pass, not on the prefill's queries)."""

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> torch.Tensor:
        """Importance of every entry, ``(B, H, N)`` float32; higher is kept first."""
        raise NotImplementedError

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> torch.Tensor | None:
        """Entries that must be kept whatever their score, ``(B, H, N)`` bool, or None."""
        return None

    def layer_budgets(self, ctx: CompressionContext) -> list[torch.Tensor]:
        """Entries per KV head for every layer, ``(B,)`` each (or ``(B, H)``: per head); uniform by default."""
        per_row = ctx.row_budgets
        return [per_row.clone() for _ in range(ctx.num_layers)]

    def target_counts(
        self, layer_idx: int, layer: FoldedLayer, selected: torch.Tensor, ctx: CompressionContext
    ) -> torch.Tensor:
        """Entries each head of a layer holds after compression, ``(B, H)``, given the ``selected``
        counts of a pre-selection (:attr:`CompressionContext.selection_scale` > 1): the selection's
        shape over the heads scaled back to the budget; the selected counts without one."""
        if ctx.selection_scale == 1.0:
            return selected
        return torch.floor(selected.double() / ctx.selection_scale).long().clamp(min=1).minimum(selected)

    def online_policy(self, ctx: CompressionContext):
        return None


class Wrapper(Allocator):
    """A prefix that changes scores and/or how a layer's budget is spread over its heads."""

    role: ClassVar[str] = "wrapper"

    def rescore(
        self, layer_idx: int, layer: FoldedLayer, scores: torch.Tensor, ctx: CompressionContext
    ) -> torch.Tensor:
        return scores

    def select(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        received: torch.Tensor,
        scores: torch.Tensor,
        counts: torch.Tensor,
        protected: torch.Tensor | None,
        valid: torch.Tensor,
        ctx: CompressionContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Choose the kept entries, or None for the default ``topk_keep(scores, counts, …)``.

        Args:
            received: the scores this wrapper's :meth:`rescore` was given (e.g. attention scores).
            scores: the final scores after every wrapper's rescore.
            counts: ``(B, H)`` final per-head counts.

        Returns:
            ``(keep (B, H, K), lengths (B, H))`` as :func:`kvfold.methods.core.selection.topk_keep`. When
            several wrappers select, the innermost one decides.
        """
        return None


class Folder(Method):
    """Decides what happens to evicted entries (merged into carriers, refitted, …)."""

    role: ClassVar[str] = "folder"
    one_shot: ClassVar[bool] = False
    """True: a spec with this folder compresses once after prefill and the selector's decode-time
    policy is not used (``h2o+grkv`` = one-shot H2O, then GRKV), instead of being an error."""

    @classmethod
    def default_selector(cls) -> str | None:
        """The selector spec a bare use of this folder's name implies (``grkv`` = ``snapkv+grkv``).

        None means the folder cannot be used alone. A standalone's name means that bare use is
        the standalone instead, given the bare options (``kvmerger[sigma=1]`` =
        ``kvmerger_sets[sigma=1]``), for a folder whose paper method is not selector + folder.
        """
        return None

    def bind_selector(self, selector: Selector | Standalone) -> None:
        """Called once when this folder is composed after ``selector`` (e.g. to choose reference
        queries that fit the selector's protocol); nothing by default."""

    def check_wrappers(self, wrappers: tuple[Wrapper, ...]) -> None:
        """Raise :class:`SpecError` when this folder, with its options, cannot follow ``wrappers``
        (called once when composed); nothing by default."""

    def fold(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        keep: torch.Tensor,
        lengths: torch.Tensor,
        scores: torch.Tensor,
        ctx: CompressionContext,
    ) -> None:
        """Write the layer's new content given kept indices ``keep`` ``(B, H, K)`` and ``lengths``."""
        raise NotImplementedError

    def reselect(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        keep: torch.Tensor,
        lengths: torch.Tensor,
        scores: torch.Tensor,
        protected: torch.Tensor | None,
        valid: torch.Tensor,
        ctx: CompressionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Revise the selector's kept entries before :meth:`fold` (KeepKV merges before it evicts).

        Returns ``(keep, lengths)`` as :func:`kvfold.methods.core.selection.topk_keep`; unchanged by default.
        """
        return keep, lengths

    def online_policy(self, policy, ctx: CompressionContext):
        """Fold what the selector's decode-time ``policy`` evicts: return the policy to use, or None
        when this folder cannot run online (then ``SELECTOR+folder`` with an online selector is an error)."""
        return None


# ------------------------------------------------------------------------- registry

REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add a method to the registry under ``cls.name``."""
    if not cls.name or cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


def available_methods(role: str | None = None) -> list[type[Method]]:
    """Registered method classes (optionally of one role), sorted by name.

    The built-in methods register when :mod:`kvfold.methods` is imported (its ``__init__`` imports
    :mod:`kvfold.methods.builtin`), which importing this module already does.
    """
    return sorted((c for c in REGISTRY.values() if role is None or c.role == role), key=lambda c: c.name)


def _lookup(component: Component, roles: tuple[str, ...], where: str) -> Method:
    cls = REGISTRY.get(component.name)
    if cls is None or cls.role not in roles:
        valid = ", ".join(c.name for c in available_methods() if c.role in roles)
        found = f" ({component.name!r} is a {cls.role})" if cls is not None else ""
        raise SpecError(f"unknown {where} {component.name!r}{found}; valid: {valid}")
    return cls.from_options(component.options)


# ------------------------------------------------------------------------- composition


def gather_entries(
    layer: FoldedLayer, keep: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and β of the kept entries, ``(B, H, K, ·)``, from padded content."""
    keys, values, log_mass, _ = layer.padded()
    idx = keep[..., None]
    k = torch.gather(keys, 2, idx.expand(-1, -1, -1, keys.shape[-1]))
    v = torch.gather(values, 2, idx.expand(-1, -1, -1, values.shape[-1]))
    lm = torch.gather(log_mass, 2, keep)
    slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
    lm = torch.where(slot, lm, torch.full_like(lm, NEG_INF))
    return k, v, lm


@dataclass
class ComposedMethod:
    """A parsed spec turned into objects: wrappers, a selector (or standalone), a folder."""

    spec: str
    wrappers: tuple[Wrapper, ...]
    selector: Selector | Standalone
    folder: Folder | None
    quant: QuantConfig | None = None
    """How the compressed entries are stored (``METHOD@int4``); None: in the model's dtype."""
    precision_fixed: bool = False
    """True when the spec names its storage (``@int4``, or ``@16`` for the model's dtype): a memory
    budget then spends its bytes on tokens at that precision instead of choosing one."""

    def __post_init__(self) -> None:
        if self.folder is not None:
            self.folder.bind_selector(self.selector)
            self.folder.check_wrappers(self.wrappers)

    @property
    def query_window(self) -> int:
        return max(p.query_window for p in self.parts)

    @property
    def is_identity(self) -> bool:
        """Whether the method keeps every entry (``full``, stored quantized or not)."""
        return getattr(self.selector, "name", "") == "full"

    @property
    def is_lossless(self) -> bool:
        """Whether the method keeps every entry in the model's dtype: the uncompressed cache."""
        return self.is_identity and self.quant is None

    @property
    def uses_repeat_pass(self) -> bool:
        """True when a part runs the repeat pass (KVzip's scores, AM's repeat-prefill queries)."""
        return any(part.uses_repeat_pass for part in self.parts)

    @property
    def fits_by_attention_matching(self) -> bool:
        """True when a part fits β and values by Attention Matching's least squares."""
        return any(part.fits_by_attention_matching for part in self.parts)

    def repeat_records(self, ctx: CompressionContext | None = None) -> frozenset[str]:
        """What the parts read from the repeat pass (:meth:`Method.repeat_records`), together."""
        return frozenset().union(*(part.repeat_records(ctx) for part in self.parts))

    @property
    def parts(self) -> list[Method]:
        """Wrappers (outermost first), the selector, and the folder if any."""
        return [*self.wrappers, self.selector, *([self.folder] if self.folder else [])]

    def prefill_observers(self) -> list:
        """The parts' prefill observers, one per ``key``."""
        found: dict[str, Any] = {}
        for part in self.parts:
            for observer in part.prefill_observers():
                found.setdefault(observer.key, observer)
        return list(found.values())

    def compress(self, ctx: CompressionContext) -> None:
        """Compress ``ctx.cache`` in place to ``ctx.budget``."""
        ctx.memo["repeat_records"] = self.repeat_records(ctx)
        if isinstance(self.selector, Standalone):
            self.selector.compress(ctx)
            return
        for part in reversed(self.parts):
            part.prepare(ctx)
        budgets = self.selector.layer_budgets(ctx)
        for wrapper in reversed(self.wrappers):
            budgets = wrapper.plan(self, budgets, ctx)
        for layer_idx, layer in ctx.cache.folded_layers:
            self._compress_layer(layer_idx, layer, budgets[layer_idx], ctx)
            ctx.memo.pop(("layer_scores", layer_idx), None)

    def layer_scores(
        self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A layer's final scores ``(B, H, N)`` float32 (the selector's, rescored by every wrapper,
        innermost first) and the scores each wrapper's rescore was given; computed once per
        compression (kept in ``ctx.memo`` until the layer is compressed)."""
        key = ("layer_scores", layer_idx)
        if key not in ctx.memo:
            scores = self.selector.score(layer_idx, layer, ctx).float()
            received = []  # the scores each wrapper's rescore was given, innermost first
            for wrapper in reversed(self.wrappers):
                received.append(scores)
                scores = wrapper.rescore(layer_idx, layer, scores, ctx)
            ctx.memo[key] = (scores, received)
        return ctx.memo[key]

    def apply(self, ctx: CompressionContext) -> Any:
        """Compress ``ctx.cache`` in place (unless the method or the budget keeps everything), store
        its entries quantized when the method (or the cache, for a re-compaction) names a format,
        and return the online policy that holds the budget while decoding (None when there is none)."""
        quant = self.quant or ctx.cache.quant
        ctx.quant = quant
        with torch.inference_mode():
            if not self.is_identity and not ctx.budget.is_full:
                self.compress(ctx)
            policy = None if ctx.budget.is_full else self.online_policy(ctx)
            if quant is not None:
                if policy is not None:
                    raise SpecError(
                        f"{self.spec}: a quantized cache cannot be compressed while decoding; write the "
                        f"selector one-shot (e.g. {self.selector.name}[online=false]) or drop the @format"
                    )
                ctx.cache.quantize(quant)
            return policy

    def online_policy(self, ctx: CompressionContext):
        if self.folder is not None and self.folder.one_shot:
            return None
        policy = self.selector.online_policy(ctx)
        if policy is not None and self.folder is not None and not self.wrappers:
            folded = self.folder.online_policy(policy, ctx)  # e.g. KeepKV merges the policy's victims
            if folded is not None:
                return folded
        if policy is not None and (self.wrappers or self.folder is not None):
            raise SpecError(
                f"{self.spec}: online (decode-time) compression is available for the plain selector only; "
                f"write {self.selector.name}[online=false] to compose it one-shot"
            )
        return policy

    def _compress_layer(
        self, layer_idx: int, layer: FoldedLayer, per_row: torch.Tensor, ctx: CompressionContext
    ) -> None:
        from kvfold.methods.core.selection import topk_keep

        valid = layer.valid_mask()
        n_valid = valid.sum(-1)  # (B, H)
        per_row = per_row.to(valid.device)
        per_head = per_row[:, None].expand_as(n_valid) if per_row.dim() == 1 else per_row  # (B, H) from plan()
        counts = torch.minimum(per_head, n_valid)
        if bool((counts >= n_valid).all()):
            return  # nothing to evict in this layer
        scores, received = self.layer_scores(layer_idx, layer, ctx)
        protected = self.selector.protected(layer_idx, layer, ctx)
        counts = self.selector.allocate(layer_idx, layer, scores, counts, protected, ctx)
        for wrapper in reversed(self.wrappers):
            counts = wrapper.allocate(layer_idx, layer, scores, counts, protected, ctx)
        chosen = None
        for wrapper, given in zip(reversed(self.wrappers), received, strict=True):
            chosen = wrapper.select(layer_idx, layer, given, scores, counts, protected, valid, ctx)
            if chosen is not None:
                break
        keep, lengths = chosen if chosen is not None else topk_keep(scores, counts, protected, valid)
        if self.folder is not None:
            keep, lengths = self.folder.reselect(layer_idx, layer, keep, lengths, scores, protected, valid, ctx)
        ctx.record_kept(layer_idx, keep, lengths)
        stats = {name: torch.gather(t, 2, keep) for name, t in layer.entry_stats.items() if t.shape == valid.shape}
        if self.folder is not None:
            self.folder.fold(layer_idx, layer, keep, lengths, scores, ctx)
        else:
            layer.replace(*gather_entries(layer, keep, lengths), lengths=lengths)
        # statistics follow the kept entries (ascending position order); a folder's own win
        layer.entry_stats = {**stats, **layer.entry_stats}


def build_method(spec: str | ParsedSpec) -> ComposedMethod:
    """Turn a spec string into a runnable method; errors list what is valid.

    Example:
        >>> build_method("adakv:snapkv[window=64]+grkv")  # doctest: +SKIP
    """
    quant, original = None, spec
    if isinstance(spec, str):
        spec, quant = split_format(spec)
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    parsed = _expand_bare_folder(parsed)
    selector = _lookup(parsed.selector, ("selector", "standalone"), "method")
    if selector.role == "standalone" and (parsed.wrappers or parsed.folder):
        raise SpecError(f"{parsed.text}: {parsed.selector.name!r} is a complete method; it takes no wrapper or folder")
    wrappers = tuple(_lookup(c, ("wrapper",), "wrapper") for c in parsed.wrappers)
    folder = _lookup(parsed.folder, ("folder",), "folder") if parsed.folder else None
    fixed = quant is not None or (isinstance(original, str) and split_format(original)[0] != original)
    text = parsed.text if quant is None else f"{parsed.text}@{quant.describe()}"
    if fixed and quant is None:
        text = f"{parsed.text}@16"
    return ComposedMethod(
        spec=text, wrappers=wrappers, selector=selector, folder=folder, quant=quant, precision_fixed=fixed
    )


def split_format(spec: str) -> tuple[str, QuantConfig | None]:
    """``"kvzip+am_fit@int4[key_group=64]"`` → ``("kvzip+am_fit", QuantConfig(int4, key_group=64))``:
    the storage format after the last ``@`` outside brackets (``@int8``, ``@int4``, ``@int3``,
    ``@int2``, ``@fp8``, ``@16`` for none).

    Raises:
        SpecError: an unknown format or option.
    """
    depth, at = 0, -1
    for i, ch in enumerate(spec):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "@" and depth == 0:
            at = i
    if at < 0:
        return spec, None
    try:
        return spec[:at], QuantConfig.parse(spec[at + 1 :])
    except QuantSpecError as err:
        raise SpecError(f"{spec!r}: {err}") from None


def with_format(spec: str, kv_format: str | int | None) -> str:
    """``spec`` stored in ``kv_format`` (``--kv-bits``): appended unless the spec names its own format."""
    if kv_format is None or split_format(spec)[1] is not None or "@" in spec:
        return spec
    try:
        config = QuantConfig.parse(kv_format)
    except QuantSpecError as err:
        raise SpecError(str(err)) from None
    return spec if config is None else f"{spec}@{config.describe()}"


def _expand_bare_folder(parsed: ParsedSpec) -> ParsedSpec:
    """A folder named alone (``grkv[lam=0.1]``) runs on its default selector (``snapkv+grkv[lam=0.1]``),
    or is the standalone its ``default_selector`` names (``kvmerger`` = ``kvmerger_sets``)."""
    cls = REGISTRY.get(parsed.selector.name)
    if cls is None or cls.role != "folder" or parsed.folder is not None:
        return parsed
    default = cls.default_selector()
    if default is None:
        name = parsed.selector.name
        raise SpecError(f"{name!r} is a folder: use it after a selector, e.g. snapkv+{name}")
    base = parse_spec(default)
    target = REGISTRY.get(base.selector.name)
    if target is not None and target.role == "standalone" and not base.wrappers and base.folder is None:
        name = parsed.selector.name
        unknown = sorted(set(parsed.selector.options) - set(target.option_names()))
        if unknown:
            raise SpecError(
                f"{name!r} alone is the standalone {target.name!r}, which has no option(s) {', '.join(unknown)} "
                f"(valid: {', '.join(target.option_names())}); the folder's options apply after a selector, "
                f"e.g. snapkv+{name}[...]"
            )
        options = {**base.selector.options, **parsed.selector.options}  # kvmerger → kvmerger_sets
        return ParsedSpec(
            wrappers=parsed.wrappers, selector=Component(base.selector.name, options), folder=None, text=parsed.text
        )
    return ParsedSpec(
        wrappers=parsed.wrappers + base.wrappers, selector=base.selector, folder=parsed.selector, text=parsed.text
    )


def apply_kv_bits(spec: str, kv_bits: str | int | None) -> str:
    """``spec`` stored in ``kv_bits`` (the ``--kv-bits`` of a sweep): every method that names no
    format, except the uncompressed ``full``, which stays the reference."""
    if kv_bits is None or build_method(spec).is_lossless:
        return spec
    return with_format(spec, kv_bits)
