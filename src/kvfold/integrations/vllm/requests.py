"""Requests that name a kvfold cache: which caches a folder holds, checking one, and the prompt vLLM runs.

A request names a cache by its file's stem (``"doc"`` for ``DIR/doc.kvc``) in
``kv_transfer_params["kvfold_cache"]``. :meth:`CacheCatalog.prepare` checks the file as
``kvfold ask`` loads it (:func:`kvfold.store.load.load_context`: format, checksum, the model's
fingerprint, dtype) plus what serving needs (:func:`~kvfold.integrations.vllm.layout.check_servable`,
no decode-time policy), and returns the prompt token ids: ``slots`` placeholder tokens (their keys and
values are loaded from the file by :class:`~kvfold.integrations.vllm.connector.KvfoldConnector`, never
computed) followed by the tokens ``kvfold ask`` appends to the cache: the question, the end of the
template's user turn, the assistant header and the answer prefix
(:func:`kvfold.runtime.prompts.build_prompt`). It also returns the ``kv_transfer_params`` the
connector reads (the cache's name, checksum and slot count) and a prefix-cache salt made of the
file's checksum, so that vLLM's prefix cache shares blocks only between requests on the same file.

Checking a file needs the model as kvfold loads it (:func:`kvfold.runtime.models.load_model`), once
per process; its verdict is kept per file (path, inode, size and modification time). A check reads the
file more than once (its header, its tensors); a file replaced between those reads (``os.replace``, as
a writer does) would look damaged, so a check during which the file changed is done again, up to
:data:`CHECK_TRIES` times, and then answered 503 ("ask again"), never 422.

Checks run in the API server's threads, one file at a time (checks side by side measured slower on two
cores: 24 new 5K-token files in 2.8–3.5 s against 2.0 s), while a request on a file whose verdict holds
takes no lock and never waits for another file's check.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfold.runtime.errors import UserError

KV_KEY = "kvfold_cache"
"""The ``kv_transfer_params`` key that names a cache."""
PREFIX_KEY = "kvfold_answer_prefix"
"""Optional ``kv_transfer_params`` key: the answer prefix (``kvfold ask --answer-prefix``)."""
SUFFIX = ".kvc"
CHECK_TRIES = 3
"""Checks of a file that changed while it was checked, before the request is answered 503."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CacheRequestError(UserError):
    """A request naming a cache that cannot be served; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CheckedCache:
    """A cache file that passed every check.

    Attributes:
        name: the request's name for it (the file's stem).
        path: the file.
        checksum: the file's SHA-256 checksum (from its header), which the connector checks again.
        logical_length: T, the context's positions.
        slots: entries per layer and head as served (the longest row).
        method: the method spec the file was made with.
        budget: its budget.
    """

    name: str
    path: Path
    checksum: str
    logical_length: int
    slots: int
    method: str
    budget: str


@dataclass
class PreparedRequest:
    """What vLLM runs for a question on a cache: prompt ids, ``kv_transfer_params`` and salt."""

    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    cache_salt: str
    max_tokens: int
    cache: CheckedCache


def _not_served(name: str) -> CacheRequestError:
    return CacheRequestError(f"no cache named {name!r} is served (see GET /v1/kvfold/caches)", status=404)


def _stamp(path: Path) -> tuple[int, int, int]:
    """What tells one version of a file from another: inode, size, modification time.

    Raises:
        CacheRequestError: the file is gone (404).
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise _not_served(path.stem) from None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def cache_path(directory: str | os.PathLike, name: Any) -> Path:
    """``DIR/name.kvc`` for a valid name.

    Raises:
        CacheRequestError: a name that is not a plain file stem (404 when no such file).
    """
    if not isinstance(name, str) or not NAME.match(name):
        raise CacheRequestError(
            f"{KV_KEY} must be the name of a cache file without {SUFFIX} (letters, digits, '.', '_', '-'); got {name!r}"
        )
    path = Path(directory) / f"{name}{SUFFIX}"
    if not path.is_file():
        raise _not_served(name)
    return path


class CacheCatalog:
    """The caches of one folder for one model, checked on demand.

    Args:
        directory: the folder of ``.kvc`` files.
        model: the model spec (``kvfold.load_model``'s), the one vLLM serves.
        dtype: the dtype vLLM serves in (``float32``, ``bfloat16``, ``float16``): a block's bytes, so
            the placeholders a file takes, depend on it.
    """

    def __init__(self, directory: str | os.PathLike, model: str, dtype: str = "float32") -> None:
        import torch

        self.directory = Path(directory)
        self.model_spec = model
        self.dtype = getattr(torch, dtype)
        self._model = None
        self._tokenizer = None
        self._verdicts: dict[Path, tuple[tuple[int, int, int], CheckedCache | CacheRequestError]] = {}
        self._lock = threading.Lock()  # one check at a time
        self._model_lock = threading.Lock()  # the model loaded once

    # ------------------------------------------------------------------ model
    def _load(self):
        with self._model_lock:
            if self._model is None:
                from kvfold.runtime.models import load_model

                self._model, self._tokenizer = load_model(self.model_spec, dtype="float32", device="cpu")
        return self._model, self._tokenizer

    @property
    def tokenizer(self):
        return self._load()[1]

    # ------------------------------------------------------------------ listing
    def listing(self) -> list[dict[str, Any]]:
        """Every ``.kvc`` file of the folder, from its header: name, method, budget, tokens, bytes
        (a file whose header cannot be read is listed with its ``error``)."""
        from kvfold.store.format import CacheFileError, read_info

        rows = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            row: dict[str, Any] = {"name": path.stem}
            try:
                info = read_info(path)
                row.update(
                    method=info.method,
                    budget=info.budget,
                    context_tokens=(info.context_tokens or [None])[0],
                    file_bytes=info.file_bytes,
                )
            except CacheFileError as err:
                row["error"] = str(err)
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ checks
    def check(self, name: Any) -> CheckedCache:
        """The checked cache ``name`` (kept per file until the file changes).

        Raises:
            CacheRequestError: unknown name (404), a file that cannot be served (422), with why, or a file
                that changed during each of :data:`CHECK_TRIES` checks (503).
        """
        path = cache_path(self.directory, name)
        kept = self._verdicts.get(path)
        if kept is None or kept[0] != _stamp(path):
            kept = self._check_now(name, path)
        verdict = kept[1]
        if isinstance(verdict, CacheRequestError):
            raise verdict
        return verdict

    def _check_now(self, name: str, path: Path) -> tuple[tuple[int, int, int], CheckedCache | CacheRequestError]:
        """The verdict on the file at ``path`` now: checked under the catalog's lock, unless a thread that
        held it before has just checked this version."""
        with self._lock:
            for _ in range(CHECK_TRIES):
                stamp = _stamp(path)
                kept = self._verdicts.get(path)
                if kept is not None and kept[0] == stamp:
                    break
                kept = (stamp, self._check(name, path))
                if _stamp(path) == stamp:  # the same file from start to end: its verdict holds
                    self._verdicts[path] = kept
                    break
            else:
                raise CacheRequestError(
                    f"cache {name!r} was replaced while it was being checked, {CHECK_TRIES} times; ask again", 503
                )
        return kept

    def _check(self, name: str, path: Path) -> CheckedCache | CacheRequestError:
        from kvfold.integrations.vllm.layout import UnservableCacheError, check_servable
        from kvfold.integrations.vllm.pool_layout import served_plan
        from kvfold.integrations.vllm.settings import BLOCK_SIZE
        from kvfold.store.format import CacheFileError
        from kvfold.store.load import load_context

        model, tokenizer = self._load()
        try:
            context = load_context(path, model, tokenizer)
            if context.policy is not None:
                raise UnservableCacheError(
                    f"its method {context.method.spec} compresses while decoding (an online policy), which vLLM "
                    "does not run; serve a one-shot method's cache (kvzip, kvzip+am_fit, snapkv, adakv:…)"
                )
            from kvfold.store.format import read_info

            header = read_info(path).header
            check_servable(context.cache, header)
            served = served_plan(context.cache, model.config, BLOCK_SIZE, self.dtype)
        except (CacheFileError, UnservableCacheError) as err:
            return CacheRequestError(f"cache {name!r} cannot be served: {err}", status=422)
        return CheckedCache(
            name=name,
            path=path,
            checksum=str((header.get("checksum") or {}).get("value")),
            logical_length=int(context.cache.layers[0].logical_length),
            slots=served.placeholders,
            method=context.method.spec,
            budget=context.budget.label(),
        )

    # ------------------------------------------------------------------ prompts
    def prepare(
        self, name: Any, question: str, *, answer_prefix: str = "", max_tokens: int | None = None
    ) -> PreparedRequest:
        """The prompt and parameters that answer ``question`` from cache ``name`` as ``kvfold ask`` does.

        Raises:
            CacheRequestError: see :meth:`check`; or no room left in the model's positions.
        """
        from kvfold.runtime.prompts import build_prompt, encode

        checked = self.check(name)
        model, tokenizer = self._load()
        suffix = build_prompt(tokenizer, "", question, answer_prefix).suffix
        suffix_ids = encode(tokenizer, suffix, special=False)
        room = int(getattr(model.config, "max_position_embeddings", 1 << 30)) - checked.logical_length - len(suffix_ids)
        if max_tokens is None:
            max_tokens = room
        if max_tokens < 1 or max_tokens > room:
            raise CacheRequestError(
                f"cache {name!r} holds {checked.logical_length} positions and the question {len(suffix_ids)}: "
                f"{room} new tokens fit in the model's positions, {max_tokens} were asked"
            )
        placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return PreparedRequest(
            prompt_token_ids=[int(placeholder)] * checked.slots + list(suffix_ids),
            kv_transfer_params={
                KV_KEY: checked.name,
                "kvfold_checksum": checked.checksum,
                "kvfold_slots": checked.slots,
            },
            cache_salt=f"kvfold:{checked.checksum}",
            max_tokens=max_tokens,
            cache=checked,
        )

    def rewrite_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat-completions body naming a cache, rewritten to run on it (a new dict).

        The question is the content of the one user message; ``kv_transfer_params["prompt_token_ids"]``
        (vLLM's forwarded prompt ids) carries the prompt, and ``cache_salt`` the file's checksum.

        Raises:
            CacheRequestError: several or no user messages, other roles, non-text content, or
                :meth:`prepare`'s errors.
        """
        params = dict(body.get("kv_transfer_params") or {})
        name = params.get(KV_KEY)
        messages = body.get("messages")
        if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict):
            raise CacheRequestError(
                "a request on a kvfold cache takes exactly one message, the user's question (the cache holds the "
                "context and its template's start)"
            )
        message = messages[0]
        if message.get("role") != "user":
            raise CacheRequestError(f"the message must be the user's; got role {message.get('role')!r}")
        question = _text(message.get("content"))
        prefix = params.pop(PREFIX_KEY, "")
        if not isinstance(prefix, str):
            raise CacheRequestError(f"{PREFIX_KEY} must be a string")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise CacheRequestError("max_tokens must be an integer")
        prepared = self.prepare(name, question, answer_prefix=prefix, max_tokens=limit)
        params.update(prepared.kv_transfer_params)
        params["prompt_token_ids"] = prepared.prompt_token_ids
        out = dict(body)
        out["kv_transfer_params"] = params
        salt = body.get("cache_salt")
        out["cache_salt"] = prepared.cache_salt if not salt else f"{prepared.cache_salt}:{salt}"
        if limit is None:
            out["max_tokens"] = prepared.max_tokens
        return out


def _text(content: Any) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise CacheRequestError("the question must be text (a string or text parts)")
