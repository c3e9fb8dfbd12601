"""Sweeps on a Ray cluster: ``kvfold eval --ray``, ``kvfold fidelity --ray``, ``kvfold bench --ray``.

A sweep is cut into work items (:class:`~kvfold.evaluate.running.sweep.SweepItem`: for ``eval``
:class:`~kvfold.evaluate.running.runner.WorkItem` and for ``fidelity``
:class:`~kvfold.evaluate.running.fidelity.FidelityItem`, one context with all its methods and budgets, so a
context is prefilled once; for ``bench`` :class:`kvfold.evaluate.bench.speed.BenchItem`, one length and batch),
and the items are answered by Ray actors that each load the model once (:class:`SweepWorker`).
The driver — the process that runs :func:`~kvfold.evaluate.running.sweep.collect_rows` — keeps each row
once, appends it to the sweep's file as it arrives, counts it on the progress bar, and at the end
writes the same rows in the same order, and the same results, as a serial run of the same grid.
The mechanism is written once (:class:`RayRunner`, :func:`run_on_ray`); what an item does is the
item's ``run(model, tokenizer)``.

Faults: each item streams its answers back one by one. When a worker dies (its process killed,
its node lost), the answers it delivered are kept, the rest of its item goes back to the front of
the queue (with the delivered answers marked done) for the next free worker, and a new worker
replaces the lost one. The sweep gives up when one item has lost ``max_attempts`` workers; an
error raised by the item itself (a bad spec, a bug) is not retried but raised as it is.

Ray is optional (``pip install 'kvfold[ray]'``) and imported only when a sweep runs on it.

A sweep runs on Ray as it runs here, with the runner swapped: :func:`run_on_ray` takes the sweep's
``run`` (:meth:`~kvfold.evaluate.running.runner.EvalSweep.run`,
:meth:`~kvfold.evaluate.running.fidelity.FidelitySweep.run`, or any driver of a :class:`RayRunner`).

Example:
    >>> from kvfold.evaluate.running.distributed import ModelLoader, run_on_ray
    >>> from kvfold.evaluate.running.runner import EvalSweep
    >>> sweep = EvalSweep(samples, ["full", "snapkv"], [0.1], run_config={}, out_dir="runs/r")
    >>> result, runner = run_on_ray(ModelLoader("smollm2-135m"), sweep.run, workers=2)  # a local Ray
    >>> runner.answers_by_worker  # {"host:pid": answers, ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from kvfold.evaluate.running.sweep import SweepItem
from kvfold.runtime.errors import UserError

R = TypeVar("R")

__all__ = [
    "LOCAL_OBJECT_STORE_BYTES",
    "ModelLoader",
    "RayRunner",
    "RayUnavailableError",
    "SweepWorker",
    "ray_session",
    "require_ray",
    "run_on_ray",
]

RAY_INSTALL_HINT = "pip install 'kvfold[ray]'"
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
"""Object store of a local Ray instance: items and answers are small JSON-like objects."""


class RayUnavailableError(UserError):
    """Ray is not installed (a user error: the command line reports it in one line, with how to install it)."""


def require_ray() -> ModuleType:
    """Import Ray, or say how to install it.

    Raises:
        RayUnavailableError: Ray is not importable.
    """
    try:
        import ray
    except ImportError as err:
        raise RayUnavailableError(
            f"--ray needs Ray, which is not installed ({err}); install it with: {RAY_INSTALL_HINT}"
        ) from err
    return ray


@dataclass(frozen=True)
class ModelLoader:
    """How a worker loads the model: a picklable call of :func:`kvfold.runtime.models.load_model`.

    Attributes:
        spec: the model spec (``smollm2-135m``, a ``.gguf``, a directory or a hub id) as every
            worker's machine resolves it.
        dtype: ``auto``, ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` (on the worker's machine).
    """

    spec: str
    dtype: str = "auto"
    device: str = "auto"

    def __call__(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` with the kvfold attention."""
        from kvfold.runtime.models import load_model

        return load_model(self.spec, dtype=self.dtype, device=self.device)


class SweepWorker:
    """The body of a Ray actor: loads the model once, then answers work items one at a time.

    Args:
        loader: returns ``(model, tokenizer)``, called once in the actor's process; None for items
            that need no model in the worker (``bench``'s, which measure in child processes).
        threads: torch threads of this worker (its CPU share); None leaves torch's default.
    """

    def __init__(self, loader: Callable[[], tuple[Any, Any]] | None, threads: int | None = None):
        self.model = self.tokenizer = None
        if loader is not None:
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.model, self.tokenizer = loader()

    def name(self) -> str:
        """``host:pid`` of this worker (also tells the driver the model is loaded)."""
        return f"{socket.gethostname()}:{os.getpid()}"

    def run(self, item: SweepItem) -> Iterator[dict[str, Any]]:
        """The item's rows, streamed back one by one as each is produced."""
        yield from item.run(self.model, self.tokenizer)


@dataclass
class _Running:
    """An item being answered: on which worker, and the answers it has delivered so far."""

    actor: Any
    name: str
    item: SweepItem
    delivered: set[Any] = field(default_factory=set)


@dataclass
class _Pool:
    """The state of one :class:`RayRunner` call: the actors (loading the model, idle, or running an
    item), the items still queued, and how often each item lost its worker."""

    actor_class: Any
    threads: int
    queue: deque[SweepItem]
    workers: int
    starting: dict[Any, Any] = field(default_factory=dict)  # ref of name() → actor, while the model loads
    idle: list[tuple[Any, str]] = field(default_factory=list)
    running: dict[Any, _Running] = field(default_factory=dict)  # streaming generator → its item
    every: list[Any] = field(default_factory=list)
    attempts: Counter[int] = field(default_factory=Counter)
    replacements: int = 0

    def dispatch(self, status: Callable[[str], None]) -> None:
        """Give queued items to idle workers, and say how busy the workers are."""
        while self.queue and self.idle:
            actor, name = self.idle.pop()
            item = self.queue.popleft()
            self.running[actor.run.options(num_returns="streaming").remote(item)] = _Running(actor, name, item)
        busy = len(self.running)
        status(f"{busy}/{busy + len(self.idle) + len(self.starting)} workers busy, {len(self.queue)} items queued")
        if not self.running and not self.starting:  # pragma: no cover - a new worker always replaces a lost one
            raise RuntimeError("no Ray worker left to answer the remaining items")

    def loaded(self, ray: ModuleType, ref: Any) -> None:
        """A starting worker answered ``name()``: its model is loaded, it is idle (or it failed to load)."""
        from ray.exceptions import RayActorError, RayTaskError

        actor = self.starting.pop(ref)
        try:
            self.idle.append((actor, ray.get(ref)))
        except (RayActorError, RayTaskError) as err:
            raise RuntimeError(
                "a Ray worker could not load the model (is kvfold installed on every node, and the "
                f"model reachable there?): {err}"
            ) from err


class RayRunner:
    """An :data:`~kvfold.evaluate.running.sweep.ItemRunner` on Ray actors (see the module docstring).

    Needs a connected Ray (:func:`ray_session`). Workers are started when items are run and
    killed when the last answer is in (or on an error).

    Args:
        loader: loads ``(model, tokenizer)`` in each worker (:class:`ModelLoader`); None: no model.
        workers: how many actors; by default as many as the cluster's CPUs (GPUs, when
            ``gpus_per_worker`` > 0) allow, and never more than there are items.
        cpus_per_worker: CPUs reserved by each actor (also its torch threads).
        gpus_per_worker: GPUs reserved by each actor (0 on CPU clusters).
        max_attempts: how many times one item may lose its worker; at the last the sweep gives up.
        kill_after: fault injection for tests: kill (``ray.kill``) the worker that delivered the
            sweep's ``kill_after``-th answer right after it arrives, once, while it works on the
            rest of its item. None in normal use.

    Attributes:
        workers_started: actors started (replacements of lost workers included).
        answers_by_worker: ``host:pid`` → answers that worker delivered (over all its items).
        worker_of: row key → ``host:pid`` of the worker that delivered it (the first delivery).
        workers_lost: workers that died while the sweep ran.
        resubmitted: items sent back to the queue after their worker died.
    """

    def __init__(
        self,
        loader: Callable[[], tuple[Any, Any]] | None,
        *,
        workers: int | None = None,
        cpus_per_worker: float = 1,
        gpus_per_worker: float = 0,
        max_attempts: int = 3,
        kill_after: int | None = None,
    ):
        if workers is not None and workers < 1:
            raise UserError(f"workers must be ≥ 1; got {workers}")
        if cpus_per_worker <= 0 or gpus_per_worker < 0:
            raise UserError(
                f"cpus_per_worker must be > 0 and gpus_per_worker ≥ 0; got {cpus_per_worker}, {gpus_per_worker}"
            )
        if max_attempts < 1:
            raise UserError(f"max_attempts must be ≥ 1; got {max_attempts}")
        self.loader = loader
        self.workers = workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.max_attempts = max_attempts
        self.kill_after = kill_after
        self.workers_started = 0
        self.answers_by_worker: Counter[str] = Counter()
        self.worker_of: dict[Any, str] = {}
        self.workers_lost = 0
        self.resubmitted = 0
        self.connect: Callable[[], Any] | None = None
        """Called once, before the first items run (:func:`run_on_ray` joins or starts Ray then,
        so a resumed sweep with nothing left to answer starts no Ray)."""

    def summary(self) -> str:
        """``Ray workers started: N; answers by Ray worker: host:pid n, ...`` (and losses), for the log."""
        by_worker = ", ".join(f"{name} {n}" for name, n in sorted(self.answers_by_worker.items()))
        lost = f"; {self.workers_lost} workers lost, {self.resubmitted} items resubmitted" if self.workers_lost else ""
        return (
            f"Ray workers started: {self.workers_started}; answers by Ray worker: "
            f"{by_worker or 'none (all resumed)'}{lost}"
        )

    def worker_count(self, items: int) -> int:
        """How many actors to start for ``items`` items on the connected cluster."""
        ray = require_ray()
        if self.workers is None:
            resources = ray.cluster_resources()
            count = int(resources.get("CPU", 1) // self.cpus_per_worker)
            if self.gpus_per_worker:
                count = min(count, int(resources.get("GPU", 0) // self.gpus_per_worker))
            if count < 1:
                have = f"{resources.get('CPU', 0)} CPUs and {resources.get('GPU', 0)} GPUs"
                raise UserError(
                    f"the Ray cluster has {have}: not enough for one worker of {self.cpus_per_worker} CPUs "
                    f"and {self.gpus_per_worker} GPUs; lower --ray-worker-gpus or add nodes"
                )
        else:
            count = self.workers
        return max(1, min(count, items))

    def __call__(self, items: Sequence[SweepItem], status: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        """Answer ``items`` on the cluster; yields each delivered row (a retried item's rows may repeat)."""
        if not items:
            return
        if self.connect is not None:
            connect, self.connect = self.connect, None
            connect()
        ray = require_ray()
        actor_class = ray.remote(SweepWorker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0, max_task_retries=0
        )
        threads = max(1, int(self.cpus_per_worker))
        pool = _Pool(actor_class, threads, deque(items), self.worker_count(len(items)))
        for _ in range(pool.workers):
            self._start(pool)
        try:
            while pool.queue or pool.running:
                pool.dispatch(status)
                ready, _ = ray.wait([*pool.running, *pool.starting], num_returns=1)
                for ref in ready:
                    if ref in pool.starting:
                        pool.loaded(ray, ref)
                        continue
                    task = pool.running[ref]
                    row = self._next_row(ray, pool, ref)
                    if row is None:
                        continue
                    yield row
                    if self.kill_after is not None and self.kill_after == self.answers_by_worker.total():
                        ray.kill(task.actor, no_restart=True)
        finally:
            for actor in pool.every:
                ray.kill(actor, no_restart=True)

    def _start(self, pool: _Pool) -> None:
        """Start one worker; it loads the model and then answers ``name()``."""
        actor = pool.actor_class.remote(self.loader, pool.threads)
        pool.every.append(actor)
        self.workers_started += 1
        pool.starting[actor.name.remote()] = actor

    def _next_row(self, ray: ModuleType, pool: _Pool, ref: Any) -> dict[str, Any] | None:
        """The next row a running item streams back, counted for its worker.

        None when the item has ended (its worker goes idle) or its worker was lost (:meth:`_lost`).

        Raises:
            Exception: what the item itself raised (a bad spec, a bug): retrying would fail the same way.
        """
        from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

        task = pool.running[ref]
        try:
            row = ray.get(next(ref))
        except StopIteration:
            del pool.running[ref]
            pool.idle.append((task.actor, task.name))
            return None
        except RayTaskError as err:  # the item itself failed: retrying would fail the same way
            raise err.as_instanceof_cause() from None
        except (RayActorError, ObjectLostError) as err:
            del pool.running[ref]
            self._lost(ray, pool, task, err)
            return None
        key = task.item.row_key(row)
        task.delivered.add(key)
        self.worker_of.setdefault(key, task.name)
        self.answers_by_worker[task.name] += 1
        return row

    def _lost(self, ray: ModuleType, pool: _Pool, task: _Running, err: Exception) -> None:
        """A worker died: its delivered rows are kept, the rest of its item is queued first, a new
        worker replaces it; after ``max_attempts`` losses of one item the sweep gives up."""
        self.workers_lost += 1
        pool.replacements += 1
        ray.kill(task.actor, no_restart=True)
        pool.attempts[task.item.index] += 1
        if pool.attempts[task.item.index] >= self.max_attempts or pool.replacements > pool.workers * self.max_attempts:
            raise RuntimeError(
                f"gave up after losing {self.workers_lost} Ray workers (the last on "
                f"{task.item.label}); rerun to resume: {err}"
            ) from err
        print(
            f"kvfold: Ray worker {task.name} lost ({type(err).__name__}); the rest of "
            f"{task.item.label} goes to another worker ({len(task.delivered)} answers kept)",
            file=sys.stderr,
        )
        pool.queue.appendleft(dataclasses.replace(task.item, skip=task.item.skip | task.delivered))
        self.resubmitted += 1
        self._start(pool)


@contextlib.contextmanager
def ray_session(address: str | None = None, *, num_cpus: int | None = None) -> Iterator[ModuleType]:
    """Connect to Ray for the duration of a ``with`` block; yields the ``ray`` module.

    Args:
        address: ``None`` or ``"local"``: start a local Ray instance (dashboard off, a small object
            store) and stop it at the end; ``"HOST:PORT"`` or ``"auto"``: connect to a running
            cluster (``ray start --head``) and disconnect at the end. When Ray is already
            initialized in this process, that connection is used and left open.
        num_cpus: CPUs of a local instance (default: this machine's cores).

    Raises:
        RayUnavailableError: Ray is not installed.
    """
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    if address in (None, "local"):
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            log_to_driver=False,
        )
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def run_on_ray(
    loader: Callable[[], tuple[Any, Any]] | None,
    sweep: Callable[[RayRunner], R],
    *,
    address: str | None = None,
    workers: int | None = None,
    cpus_per_worker: float = 1,
    gpus_per_worker: float = 0,
) -> tuple[R, RayRunner]:
    """Run ``sweep(runner)`` with a :class:`RayRunner`; the Ray session (:func:`ray_session`) is
    joined or started when the runner is first given items and closed at the end (a resumed sweep
    with nothing left starts none).

    Args:
        loader: loads ``(model, tokenizer)`` in each worker (:class:`ModelLoader`); None: no model.
        sweep: the driver, e.g. an :class:`~kvfold.evaluate.running.runner.EvalSweep`'s or a
            :class:`~kvfold.evaluate.running.fidelity.FidelitySweep`'s ``run``.
        address: as for :func:`ray_session` (None: a local instance).
        workers: actors to start; by default as many as the cluster's CPUs allow (for a local
            instance: this machine's cores, or ``workers × cpus_per_worker`` CPUs if more).
        cpus_per_worker, gpus_per_worker: resources reserved by each actor.

    Returns:
        ``(sweep's result, runner)``: the runner holds its counts (answers by worker, workers
        lost, items resubmitted).

    Raises:
        RayUnavailableError: Ray is not installed.
    """
    runner = RayRunner(loader, workers=workers, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker)
    local_cpus = os.cpu_count() or 1
    if workers is not None:
        local_cpus = max(local_cpus, int(workers * cpus_per_worker + 0.999))
    with contextlib.ExitStack() as session:  # entered when the first items run
        runner.connect = lambda: session.enter_context(ray_session(address, num_cpus=local_cpus))
        result = sweep(runner)
    return result, runner
