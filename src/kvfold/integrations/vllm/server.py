"""The OpenAI server's side of the plugin: an ASGI middleware (vLLM's ``--middleware``).

* ``GET /v1/kvfold/caches`` lists the caches the server can serve (name, method, budget, context
  tokens, file size; a file whose header cannot be read is listed with its error).
* ``POST /v1/completions`` (or ``/v1/responses``, ``/v1/messages``) naming a cache is refused (400):
  a cache is served through chat requests, where it is checked.
* A ``POST`` to those endpoints whose body is not JSON gets a one-line 400 (vLLM's own answer is a
  validation report over several lines), and one over :data:`MAX_BODY` a 413.
* ``POST /v1/chat/completions`` whose ``kv_transfer_params`` name a cache (``"kvfold_cache": "doc"``)
  is rewritten by :meth:`CacheCatalog.rewrite_chat <kvfold.integrations.vllm.requests.CacheCatalog.rewrite_chat>`
  before vLLM reads it: the prompt becomes the cache's placeholder slots and the question as
  ``kvfold ask`` appends it, carried in vLLM's forwarded ``kv_transfer_params["prompt_token_ids"]``,
  salted with the file's checksum. A cache that is unknown (404) or cannot be served (422: damaged,
  another model, an online method, quantized, …) is answered with an OpenAI-style error, one line
  that says why, and the server goes on. Every other request passes through untouched.

The folder and the model come from the environment that ``kvfold serve`` sets
(:data:`ENV_CACHES`, :data:`ENV_MODEL`).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from kvfold.integrations.vllm.requests import KV_KEY, CacheCatalog, CacheRequestError

ENV_CACHES = "KVFOLD_VLLM_CACHES"
"""The folder of ``.kvc`` files the server serves."""
ENV_DTYPE = "KVFOLD_VLLM_DTYPE"
"""The dtype vLLM serves in (``float32`` when unset): the placeholders a file takes depend on it."""
ENV_MODEL = "KVFOLD_VLLM_MODEL"
"""The model spec, as ``kvfold.load_model`` takes it (to check files against it)."""
LIST_PATH = "/v1/kvfold/caches"
CHAT_PATH = "/v1/chat/completions"
OTHER_PATHS = ("/v1/completions", "/v1/responses", "/v1/messages")
"""Endpoints that take ``kv_transfer_params`` but not a cache: refused there (the checks run on chat requests)."""
MAX_BODY = 64 << 20


class KvfoldMiddleware:
    """ASGI middleware: lists the caches, rewrites chat requests that name one (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app
        caches, model = os.environ.get(ENV_CACHES), os.environ.get(ENV_MODEL)
        if not caches or not model:
            raise RuntimeError(f"KvfoldMiddleware needs {ENV_CACHES} and {ENV_MODEL} (kvfold serve sets them)")
        self.catalog = CacheCatalog(caches, model, os.environ.get(ENV_DTYPE) or "float32")

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path"), scope.get("method")
        if path == LIST_PATH and method == "GET":
            rows = await asyncio.to_thread(self.catalog.listing)
            await _respond(send, 200, {"object": "list", "data": rows})
            return
        if method != "POST" or (path != CHAT_PATH and path not in OTHER_PATHS):
            await self.app(scope, receive, send)
            return
        body, whole = await _read_body(receive)
        if not whole:
            message = f"the request body is over {MAX_BODY >> 20} MiB"
            await _respond(send, 413, _error(message, 413, param=None))
            return
        try:
            data = json.loads(body) if body else None
        except ValueError as err:  # vLLM's own answer is a validation report over several lines
            message = f"the request body is not valid JSON: {str(err).splitlines()[0]}"
            await _respond(send, 400, _error(message, 400, param=None))
            return
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if isinstance(params, dict) and params.get(KV_KEY) is not None and path != CHAT_PATH:
            message = f"{KV_KEY} is served on {CHAT_PATH} only (one user message, the question)"
            await _respond(send, 400, _error(message, 400))
            return
        if isinstance(params, dict) and params.get(KV_KEY) is not None:
            try:
                data = await asyncio.to_thread(self.catalog.rewrite_chat, data)
            except CacheRequestError as err:
                await _respond(send, err.status, _error(str(err), err.status))
                return
            body = json.dumps(data).encode()
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope["headers"].append((b"content-length", str(len(body)).encode()))
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive) -> tuple[bytes, bool]:
    """The request's body, and whether it came whole (False: over :data:`MAX_BODY`)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return b"", False
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks), True


def _replay(body: bytes, receive):
    """A ``receive`` that gives the (rewritten) body once, then waits on the client's (a disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _error(message: str, status: int, param: str | None = KV_KEY) -> dict[str, Any]:
    """An OpenAI-style error body: one line of ``message``, the type for ``status``."""
    kinds = {
        404: "NotFoundError",
        413: "RequestTooLargeError",
        422: "UnprocessableEntityError",
        503: "ServiceUnavailableError",
    }
    return {"error": {"message": message, "type": kinds.get(status, "BadRequestError"), "param": param, "code": status}}


async def _respond(send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
