"""kvfold as an lm-evaluation-harness model: the prompt's context is compressed, then the rest is run.

Importing this module registers the model ``kvfold`` with lm-eval (0.4.x, ``pip install kvfold[lm-eval]``)::

    kvfold-lm-eval --model kvfold --model_args pretrained=smollm2-135m,method=snapkv+keepkv,budget=0.1 \\
        --tasks TASK --device cpu

(``kvfold-lm-eval`` is lm-eval's own command line with this module imported first: lm-eval 0.4.13 has
no plugin entry point for models.) From Python::

    import lm_eval
    from kvfold.integrations.lm_eval import KVFoldLM

    lm = KVFoldLM(pretrained="smollm2-135m", method="snapkv", budget=0.1)
    lm_eval.simple_evaluate(model=lm, tasks=["TASK"])

How a request runs (``context_split`` decides where the prompt is cut; see :class:`ContextSplit`):

* ``loglikelihood(context, continuation)``: the context is tokenized exactly as lm-eval's ``hf`` model
  tokenizes it; its **compressed part** (everything before the split) is prefilled and compressed with
  ``method`` at ``budget``; the rest of the context and the continuation are then teacher-forced over
  the compressed cache in one forward, and the continuation's log-probabilities are summed. The
  method's decode-time policy (if any) is not run inside that forward: what is scored is the
  compressed prefill cache itself (as ``kvfold fidelity`` without ``--online``).
* ``generate_until(context, gen_kwargs)``: the compressed part is prefilled and compressed the same way;
  the rest of the prompt is appended and the answer decoded greedily (the method's decode-time policy
  active, exactly as :meth:`kvfold.CompressedContext.generate`) until an ``until`` string, an EOS token
  or ``max_gen_toks`` tokens.
* Requests whose compressed parts are the same token ids (the choices of a multiple-choice question,
  several questions about one document, few-shot prompts that share their examples) share one
  prefill and one compression. ``batch_size`` distinct compressed parts are prefilled and compressed as
  one left-padded batch, and up to ``batch_size`` continuations of one compressed part are scored in
  one forward.
* ``loglikelihood_rolling`` (perplexity tasks) is refused: lm-eval scores every token of a document
  from the raw document prefix, so there is no context to compress. ``kvfold fidelity`` measures the
  negative log-likelihood under compression (``nll_delta``).

At ``budget=1.0`` (or ``method=full``) nothing is compressed and the model computes what lm-eval's own
``hf`` model computes (tested: the same log-likelihoods to 1e-4, the same greedy generations).
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

try:
    import lm_eval.models  # noqa: F401 - lm-eval's own models first: get_model imports them only into an empty registry
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvfold.integrations.lm_eval needs lm-evaluation-harness 0.4.x: pip install 'kvfold[lm-eval]'"
    ) from err

from kvfold.methods import ComposedMethod, SpecError, available_methods, build_method
from kvfold.pipeline.context import CompressedContext, eos_ids, prefill_ids
from kvfold.runtime.budget import Budget
from kvfold.runtime.models import ModelLoadError, load_model, prepare_model

__all__ = ["DEFAULT_CONTEXT_SPLIT", "DEFAULT_MAX_SUFFIX_TOKENS", "ContextSplit", "KVFoldLM", "cli_main"]

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_SPLIT = "paragraph"
"""The prompt's last paragraph (from its last blank line) stays uncompressed; see :class:`ContextSplit`."""

DEFAULT_MAX_SUFFIX_TOKENS = 64
"""At most this many tokens of the prompt's end stay uncompressed under a text rule."""

DEFAULT_MAX_LENGTH = 2048
"""Model length when the config names none (lm-eval's ``hf`` default)."""

SPLIT_KINDS = ("paragraph", "line", "sep:TEXT", "tokens:N", "all")


@dataclass(frozen=True)
class ContextSplit:
    """Where a prompt is cut into the part that is compressed and the part that is appended after.

    Rules (``context_split=`` in ``--model_args``):

    * ``paragraph`` (default): the uncompressed part starts at the prompt's last blank line
      (``"\\n\\n"``, lm-eval's default few-shot delimiter): few-shot examples or the document are
      compressed, the current question (``"\\n\\nQuestion: ...\\nAnswer:"``) is appended after, as in
      kvfold's own query-agnostic protocol. A prompt without a blank line is one paragraph.
    * ``line``: the uncompressed part starts at the prompt's last newline.
    * ``sep:TEXT``: it starts at the last occurrence of ``TEXT`` (``\\n``-style escapes are read;
      ``,`` and ``=`` cannot be written in ``--model_args``).
    * ``tokens:N``: the last ``N`` tokens stay uncompressed.
    * ``all``: the whole prompt is compressed (query-aware: the question is inside the compressed
      part, as in SnapKV's own protocol). The first continuation token is then predicted by the
      prefill's own forward, which saw the uncompressed prompt, so a one-token continuation scores
      the same at every budget.

    Under the text rules at most ``max_suffix_tokens`` (default 64) tokens stay uncompressed, so
    a prompt with no blank line, or a long last paragraph, still has its beginning compressed. At
    least one token is always compressed. The cut falls on a token boundary of the prompt's own
    tokenization (a token that straddles the cut stays uncompressed), so the tokens the model sees
    are exactly those of the uncut prompt, and ``budget=1.0`` equals the uncompressed model.
    """

    kind: str = DEFAULT_CONTEXT_SPLIT
    separator: str = ""
    tokens: int = 0
    max_suffix_tokens: int = DEFAULT_MAX_SUFFIX_TOKENS

    @classmethod
    def parse(cls, text: str | ContextSplit, max_suffix_tokens: int = DEFAULT_MAX_SUFFIX_TOKENS) -> ContextSplit:
        """Read a rule (``paragraph``, ``line``, ``sep:TEXT``, ``tokens:N``, ``all``).

        Raises:
            ValueError: an unknown rule, with the valid ones.
        """
        if isinstance(text, ContextSplit):
            return text
        if isinstance(max_suffix_tokens, bool) or not isinstance(max_suffix_tokens, int) or max_suffix_tokens < 0:
            raise ValueError(f"max_suffix_tokens must be an integer ≥ 0; got {max_suffix_tokens!r}")
        rule = str(text)
        if rule in ("paragraph", "line", "all"):
            return cls(kind=rule, max_suffix_tokens=max_suffix_tokens)
        if rule.startswith("sep:") and len(rule) > 4:
            separator = codecs.decode(rule[4:], "unicode_escape")
            return cls(kind="sep", separator=separator, max_suffix_tokens=max_suffix_tokens)
        if rule.startswith("tokens:") and rule[7:].isdigit():
            return cls(kind="tokens", tokens=int(rule[7:]), max_suffix_tokens=max_suffix_tokens)
        raise ValueError(
            f"unknown context_split {rule!r}; valid: {', '.join(SPLIT_KINDS)} "
            f"(default {DEFAULT_CONTEXT_SPLIT}: the prompt's last paragraph stays uncompressed)"
        )

    def label(self) -> str:
        if self.kind == "sep":
            return "sep:" + self.separator.encode("unicode_escape").decode()
        if self.kind == "tokens":
            return f"tokens:{self.tokens}"
        return self.kind

    def char_position(self, text: str) -> int | None:
        """Where the uncompressed text starts (None: the rule is not a text rule)."""
        if self.kind in ("tokens", "all"):
            return None
        marker = {"paragraph": "\n\n", "line": "\n"}.get(self.kind, self.separator)
        return max(text.rfind(marker), 0)

    def cut(self, ids: Sequence[int], boundary: int | None) -> int:
        """The number of leading tokens of ``ids`` to compress.

        Args:
            ids: the prompt's tokens.
            boundary: for a text rule, the first token of the uncompressed text (:meth:`char_position`
                mapped to tokens); ignored otherwise.
        """
        n = len(ids)
        if self.kind == "all":
            cut = n
        elif self.kind == "tokens":
            cut = n - self.tokens
        else:
            cut = max(int(boundary if boundary is not None else 0), n - self.max_suffix_tokens)
        return min(max(cut, 1), n)


@dataclass
class _Item:
    """One request: the tokens compressed, the tokens after them, and how many of those are scored."""

    index: int
    prefix: tuple[int, ...]
    tail: list[int]
    scored: int = 0
    until: tuple[str, ...] = ()
    max_gen_toks: int = 0


@register_model("kvfold")
class KVFoldLM(TemplateLM):
    """An lm-eval model whose prompts are answered through a compressed KV cache.

    Args (all can be given as ``--model_args key=value,...``):
        pretrained: a model spec for :func:`kvfold.load_model` (``smollm2-135m``, a local directory,
            a ``.gguf`` file, a hub id), or a model object (then ``tokenizer`` is required).
        method: a kvfold method spec (``snapkv``, ``snapkv+keepkv``, ``adakv:snapkv``, ...; see
            ``kvfold methods``). ``full`` keeps everything.
        budget: a fraction in (0, 1] of the compressed part's tokens, or a token count; ``1.0`` keeps all.
        context_split: which part of a prompt is compressed (:class:`ContextSplit`; default ``paragraph``).
        max_suffix_tokens: at most this many tokens stay uncompressed under a text rule (default 64).
        batch_size: distinct compressed parts prefilled and compressed together, and continuations of
            one compressed part scored together (``auto`` is read as 1).
        device, dtype: as :func:`kvfold.load_model` (``auto``; a CUDA device that is absent falls back
            to the CPU with a warning, since lm-eval's command line defaults to ``cuda:0``).
        seed: seed of randomized methods.
        max_length: the model's length (default: its ``max_position_embeddings``); longer requests are
            truncated from the left, as lm-eval's ``hf`` model does.
        max_gen_toks: default generation limit when a task gives none (256, as ``hf``).
        add_bos_token: as ``hf``: None keeps the tokenizer's default.
        tokenizer: with a model object, its tokenizer.

    Raises:
        ValueError: an unknown method, budget, context split or argument, with what is valid.
    """

    def __init__(
        self,
        pretrained: str | PreTrainedModel = "smollm2-135m",
        method: str = "full",
        budget: float | int | str = 1.0,
        context_split: str | ContextSplit = DEFAULT_CONTEXT_SPLIT,
        max_suffix_tokens: int = DEFAULT_MAX_SUFFIX_TOKENS,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        device: str | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        seed: int = 0,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            valid = (
                "pretrained, method, budget, context_split, max_suffix_tokens, batch_size, device, dtype, seed, "
                "max_length, max_gen_toks, add_bos_token"
            )
            raise ValueError(f"kvfold model: unknown argument(s) {', '.join(sorted(unknown))}; valid: {valid}")
        self.method_spec = str(method)
        try:
            self.method: ComposedMethod = build_method(self.method_spec)
        except SpecError as err:
            names = ", ".join(c.name for c in available_methods() if c.role in ("selector", "standalone"))
            raise ValueError(
                f"kvfold model: method={self.method_spec!r} is not a method spec ({err}); "
                f"methods: {names}; compose with + (e.g. snapkv+keepkv), list them with `kvfold methods`"
            ) from err
        try:
            self.budget = Budget.parse(budget)
        except ValueError as err:
            raise ValueError(
                f"kvfold model: budget={budget!r} is not valid; give a fraction in (0, 1] of the compressed part "
                "(budget=0.1 keeps 10%) or a token count (budget=512); 1.0 keeps everything"
            ) from err
        self.context_split = ContextSplit.parse(context_split, int(max_suffix_tokens))
        self.batch_size_per_row = _parse_batch_size(batch_size)
        self.seed = int(seed)
        self.add_bos_token = add_bos_token
        self._max_gen_toks = int(max_gen_toks)
        if isinstance(pretrained, str):
            try:
                model, loaded_tokenizer = load_model(pretrained, dtype=dtype, device=_usable_device(device))
            except ModelLoadError as err:
                raise ValueError(f"kvfold model: pretrained={pretrained!r}: {err}") from err
            tokenizer = tokenizer or loaded_tokenizer
        else:
            if tokenizer is None:
                raise ValueError("kvfold model: a model object needs its tokenizer (tokenizer=...)")
            model = prepare_model(pretrained)
        self.model = model
        self.tokenizer = tokenizer
        self._device = model.device
        self.pretrained = pretrained if isinstance(pretrained, str) else type(pretrained).__name__
        config = model.config.get_text_config(decoder=True)
        self._max_length = int(max_length or getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH)
        self._eos = eos_ids(model, tokenizer)
        self.kv_ratios: list[float] = []
        self.compressions = 0

    # ----------------------------------------------------------------- lm-eval's model interface

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KVFoldLM:
        """Like lm-eval's, but commas inside ``[...]`` stay in a method spec (``snapkv[window=32,pool=5]``)."""
        from lm_eval.utils import handle_arg_string

        args = {}
        for item in _split_top_level(arg_string or ""):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"kvfold model: model_args item {item!r} must be key=value")
            args[key.strip()] = handle_arg_string(value)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**args, **extra)

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_row

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kvfold")).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What ``results["config"]`` records about this model (method, budget, split, measured ratio)."""
        ratio = sum(self.kv_ratios) / len(self.kv_ratios) if self.kv_ratios else None
        return {
            "kvfold_method": self.method_spec,
            "kvfold_budget": self.budget.label(),
            "kvfold_context_split": self.context_split.label(),
            "kvfold_max_suffix_tokens": self.context_split.max_suffix_tokens,
            "kvfold_compressions": self.compressions,
            "kvfold_kv_ratio": ratio,
        }

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template, as lm-eval's ``hf`` model applies it."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Tokenize as lm-eval's ``hf`` model does (``add_bos_token``, a BOS already in the text)."""
        return list(self.tokenizer(string, **self._special_kwargs(string, add_special_tokens)).input_ids)

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _special_kwargs(self, string: str, add_special_tokens: bool | None = None) -> dict[str, bool]:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        bos_text = self.tokenizer.decode([self.prefix_token_id]) if self.prefix_token_id is not None else None
        if bos_text and string.startswith(bos_text):
            return {"add_special_tokens": False}
        if self.add_bos_token is not None:
            return {"add_special_tokens": self.add_bos_token}
        return {}

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Refused: perplexity over a document has no context part to compress (see the module docstring)."""
        raise NotImplementedError(
            "the kvfold lm-eval model does not run loglikelihood_rolling (perplexity tasks such as wikitext): "
            "lm-eval scores every token of a document from the raw document before it, so there is no context "
            "to compress. Use a loglikelihood or generate_until task, or `kvfold fidelity` (nll_delta) for the "
            "log-likelihood of a continuation under compression."
        )

    # ----------------------------------------------------------------- splitting and compressing

    def split_point(self, text: str | None, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` (the tokenization of ``text``) are compressed."""
        position = self.context_split.char_position(text) if text else None
        boundary = None if position is None else self._token_boundary(text, ids, position)
        return self.context_split.cut(ids, boundary)

    def _token_boundary(self, text: str, ids: Sequence[int], position: int) -> int:
        """The index of the first token of ``ids`` that ends after character ``position`` of ``text``."""
        if position <= 0:
            return 0
        kwargs = self._special_kwargs(text)
        try:
            enc = self.tokenizer(text, return_offsets_mapping=True, **kwargs)
            offsets = enc["offset_mapping"]
            same = list(enc["input_ids"]) == list(ids)
        except (NotImplementedError, KeyError, TypeError, ValueError):
            same = False
        if same:
            return next((i for i, (_, end) in enumerate(offsets) if end > position), len(ids))
        # tokenizers without offsets: the longest common prefix with the text before the cut
        head = self.tok_encode(text[:position])
        common = 0
        for a, b in zip(head, ids, strict=False):
            if a != b:
                break
            common += 1
        return common

    def compress(self, prefixes: Sequence[Sequence[int]]) -> CompressedContext:
        """Prefill token prefixes (a left-padded batch) and compress them with the model's method and budget."""
        longest = max(len(p) for p in prefixes)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prefixes], device=self.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prefixes], device=self.device)
        padded = bool((mask == 0).any())
        context = prefill_ids(self.model, self.tokenizer, ids, mask if padded else None, methods=[self.method])
        compressed = context.compress(self.method, self.budget, seed=self.seed)
        self.compressions += len(prefixes)
        full = compressed.kv_bytes_full
        if full:
            self.kv_ratios.extend([compressed.kv_bytes / full] * len(prefixes))
        return compressed

    def _batches(self, items: list[_Item]) -> Iterable[tuple[CompressedContext, int, list[_Item]]]:
        """Group items by compressed part; yield (compressed batch, row, the row's items), longest first."""
        groups: dict[tuple[int, ...], list[_Item]] = {}
        for item in items:
            groups.setdefault(item.prefix, []).append(item)
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[0]), kv[0]))
        for start in range(0, len(ordered), self.batch_size):
            batch = ordered[start : start + self.batch_size]
            compressed = self.compress([prefix for prefix, _ in batch])
            for row, (_, group) in enumerate(batch):
                yield compressed, row, group

    # ----------------------------------------------------------------- loglikelihood

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Score each continuation over the compressed cache of its context's compressed part."""
        items = []
        for index, (strings, context_enc, continuation_enc) in enumerate(requests):
            if not continuation_enc:
                raise ValueError("lm-eval sent an empty continuation; nothing to score")
            context_text = strings[0].rstrip() if strings and strings[0] else None
            cut = self.split_point(context_text, context_enc)
            ids = list(context_enc) + list(continuation_enc)
            drop = max(0, len(ids) - (self.max_length + 1))  # left truncation, as lm-eval's hf model
            if drop:
                log.warning("request %d is %d tokens over the model length; its first tokens are dropped", index, drop)
            ids = ids[drop:]
            cut = min(max(cut - drop, 1), len(ids) - len(continuation_enc))
            if cut < 1:
                raise ValueError(f"request {index}: the continuation alone exceeds the model length {self.max_length}")
            items.append(_Item(index=index, prefix=tuple(ids[:cut]), tail=ids[cut:], scored=len(continuation_enc)))
        results: list[tuple[float, bool] | None] = [None] * len(items)
        bar = tqdm(total=len(items), disable=disable_tqdm, desc="kvfold loglikelihood")
        for compressed, row, group in self._batches(items):
            for start in range(0, len(group), self.batch_size):
                chunk = group[start : start + self.batch_size]
                for item, answer in zip(chunk, self._score(compressed, row, chunk), strict=True):
                    results[item.index] = answer
                    strings = requests[item.index][0]
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, answer)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _score(self, compressed: CompressedContext, row: int, items: Sequence[_Item]) -> list[tuple[float, bool]]:
        """Teacher-force the items' tails over copies of one row of ``compressed`` in one forward."""
        src = compressed.source
        pad = src.input_ids.shape[1] - int(src.attention_mask[row].sum())
        first = src.last_logits[row].float()
        fed = [item.tail[:-1] for item in items]
        longest = max(len(f) for f in fed)
        logits = None
        if longest:
            cache = compressed.decode_cache(row)
            cache.policy = None  # the compressed prefill cache itself is scored (no decode-time eviction)
            if len(items) > 1:
                cache.batch_repeat_interleave(len(items))
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            ids = torch.tensor([f + [pad_id] * (longest - len(f)) for f in fed], device=self.device)
            start = cache.get_seq_length() - pad
            pos = torch.arange(start, start + longest, device=self.device)[None].expand(len(items), -1)
            logits = self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits.float()
        answers = []
        for j, item in enumerate(items):
            rows = [first[None]] + ([logits[j, : len(fed[j])]] if logits is not None else [])
            predicting = torch.cat(rows, dim=0)[-item.scored :]
            logprobs = torch.log_softmax(predicting, dim=-1)
            target = torch.tensor(item.tail[-item.scored :], device=logprobs.device)
            total = float(logprobs.gather(-1, target[:, None]).sum())
            greedy = bool((predicting.argmax(-1) == target).all())
            answers.append((total, greedy))
        return answers

    # ----------------------------------------------------------------- generation

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers over the compressed cache of each prompt's compressed part."""
        eos_id = self.eot_token_id
        eos_text = self.tok_decode([eos_id], skip_special_tokens=False) if eos_id is not None else None
        items = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(
                    "the kvfold lm-eval model decodes greedily; this task asks for sampling (do_sample/temperature): "
                    "pass --gen_kwargs do_sample=false,temperature=0"
                )
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen = int(kwargs["max_gen_toks"])
            ids = self.tok_encode(context)
            cut = self.split_point(context, ids)
            room = self.max_length - max_gen
            if room < 1:
                raise ValueError(f"max_gen_toks={max_gen} leaves no room for a prompt in {self.max_length} positions")
            drop = max(0, len(ids) - room)
            ids, cut = ids[drop:], max(cut - drop, 1)
            items.append(
                _Item(index=index, prefix=tuple(ids[:cut]), tail=ids[cut:], until=tuple(until), max_gen_toks=max_gen)
            )
        results: list[str | None] = [None] * len(items)
        bar = tqdm(total=len(items), disable=disable_tqdm, desc="kvfold generate_until")
        for compressed, row, group in self._batches(items):
            for item in group:
                text = self._generate(compressed, row, item)
                results[item.index] = text
                self.cache_hook.add_partial("generate_until", requests[item.index].args, text)
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate(self, compressed: CompressedContext, row: int, item: _Item) -> str:
        """Append the item's tail to a copy of one row (decode-time policy on) and decode greedily."""
        src = compressed.source
        cache = compressed.decode_cache(row)
        pad = src.input_ids.shape[1] - int(src.attention_mask[row].sum())
        if item.tail:
            logical = cache.get_seq_length()
            ids = torch.tensor([item.tail], device=self.device)
            pos = torch.arange(logical, logical + len(item.tail), device=self.device)[None] - pad
            logits = self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
        else:
            logits = src.last_logits[row : row + 1]
        stops = [s for s in item.until if s]
        generated: list[int] = []
        while len(generated) < item.max_gen_toks:
            token = int(logits.argmax(-1)[0])
            if token in self._eos:
                break
            generated.append(token)
            if len(generated) == item.max_gen_toks:
                break
            if stops and any(s in self.tok_decode(generated) for s in stops):
                break
            logical = cache.get_seq_length()
            ids = torch.tensor([[token]], device=self.device)
            pos = torch.tensor([[logical - pad]], device=self.device)
            logits = self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
        return postprocess_generated_text(self.tok_decode(generated), list(item.until), None)


def _parse_batch_size(value: int | str) -> int:
    text = str(value)
    if text.startswith("auto"):
        log.warning("kvfold model: batch_size=%s is read as 1 (no automatic batch size)", text)
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"kvfold model: batch_size must be a positive integer; got {value!r}")
    return int(text)


def _usable_device(device: str | None) -> str:
    """lm-eval's command line defaults to ``cuda:0``: fall back to the CPU when CUDA is absent."""
    if device is None or device == "auto":
        return "auto"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("kvfold model: device=%s but CUDA is not available; running on the CPU", device)
        return "cpu"
    return str(device)


def _split_top_level(text: str) -> list[str]:
    """Split ``a=1,b=x[c=1,d=2]`` on the commas outside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth = max(depth - 1, 0)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def cli_main() -> None:
    """``kvfold-lm-eval``: lm-eval's command line with the ``kvfold`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
