"""Argument helpers shared by the ``kvfold`` subcommands.

The command line (:mod:`kvfold.cli.main`) gathers the subcommands; a subcommand module exposes
``add_parsers(sub)`` and ``COMMANDS`` (name → handler) and takes what it shares with the others
from here, so no subcommand imports the command line itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvfold.runtime.models import DEFAULT_MODEL

Handler = Callable[[argparse.Namespace], int]
"""A subcommand: parsed arguments in, exit status out."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--device``, as every command that loads a model takes them."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model spec: smollm2-135m, a .gguf, a directory or a hub id"
    )
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    """``--memory`` (in place of ``--budget``) and ``--kv-bits``, as the commands that compress one
    context take them."""
    parser.add_argument(
        "--memory",
        type=float,
        default=None,
        help="in place of --budget: the fraction of the 16-bit full cache's bytes the compressed cache may "
        "hold (e.g. 0.0625); kvfold chooses how many tokens to keep at how many bits",
    )
    parser.add_argument(
        "--kv-bits",
        default=None,
        help="store the compressed entries as 8, 4, 3 or 2-bit integers, fp8, or 16 (the model's dtype); "
        "default: the model's dtype, or the memory rule's choice with --memory",
    )


def compress_options(args: argparse.Namespace, budget: Any) -> dict[str, Any]:
    """The keywords of :meth:`PrefilledContext.compress` for ``--budget`` / ``--memory`` / ``--kv-bits``.

    Raises:
        ValueError: both a budget and ``--memory``, or neither.
    """
    memory = getattr(args, "memory", None)
    if memory is not None and budget is not None:
        raise ValueError("give --budget or --memory, not both")
    if memory is None and budget is None:
        raise ValueError("give --budget (a fraction or a token count) or --memory (a fraction of the 16-bit cache)")
    if memory is not None:
        return {"memory": memory, "kv_format": getattr(args, "kv_bits", None)}
    return {"budget": budget, "kv_format": getattr(args, "kv_bits", None)}


def add_ray_args(parser: argparse.ArgumentParser, unit: str = "work item") -> None:
    """``--ray [ADDRESS]`` and the worker shape, as ``eval``, ``fidelity`` and ``bench`` take them
    (see :mod:`kvfold.evaluate.running.distributed`); ``unit`` names what one worker takes at a time."""
    group = parser.add_argument_group("Ray (pip install 'kvfold[ray]')")
    group.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the sweep on Ray workers that each load the model once: alone, a local Ray instance with "
        "one worker per core; with HOST:PORT (or auto), a running cluster (ray start --head)",
    )
    group.add_argument(
        "--ray-workers",
        type=int,
        default=None,
        help=f"Ray workers to start (default: as many as the CPUs allow, at most one per {unit})",
    )
    group.add_argument("--ray-worker-cpus", type=float, default=1, help="CPUs (torch threads) per worker (default 1)")
    group.add_argument("--ray-worker-gpus", type=float, default=0, help="GPUs per worker (default 0)")


def ray_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`kvfold.evaluate.running.distributed.run_on_ray` the flags give.

    Raises:
        ValueError: a worker count or shape out of range.
    """
    if args.ray_workers is not None and args.ray_workers < 1:
        raise ValueError(f"--ray-workers must be ≥ 1; got {args.ray_workers}")
    if args.ray_worker_cpus <= 0 or args.ray_worker_gpus < 0:
        raise ValueError("--ray-worker-cpus must be > 0 and --ray-worker-gpus ≥ 0")
    return {
        "address": None if args.ray == "local" else args.ray,
        "workers": args.ray_workers,
        "cpus_per_worker": args.ray_worker_cpus,
        "gpus_per_worker": args.ray_worker_gpus,
    }


def ray_where(args: argparse.Namespace) -> str:
    """``"a local Ray instance"`` or ``"the Ray cluster at ADDRESS"``, for the log."""
    return "a local Ray instance" if args.ray == "local" else f"the Ray cluster at {args.ray}"
