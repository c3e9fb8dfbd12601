"""Argument helpers shared by the ``kvfold`` subcommands.

The command line (:mod:`kvfold.cli`) gathers the subcommands; a subcommand module exposes
``add_parsers(sub)`` and ``COMMANDS`` (name → handler) and takes what it shares with the others
from here, so no subcommand imports the command line itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvfold.models import DEFAULT_MODEL

Handler = Callable[[argparse.Namespace], int]
"""A subcommand: parsed arguments in, exit status out."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--device``, as every command that loads a model takes them."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model spec: smollm2-135m, a .gguf, a directory or a hub id"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
