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
