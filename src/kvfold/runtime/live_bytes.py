"""The bytes of the tensors a stretch of work makes and holds, over time: a GPU's ``max_memory_allocated``
counted on any device, with what held the peak.

:class:`LiveBytes` is a dispatch mode: every operator's new storages are counted from the operator that
made them until their last tensor is freed, and named by a ``site`` the caller chooses (by default none).
``benchmarks/profile_compress.py --peak`` names them by phase and kvfold function and counts a compression
with a GPU's paths on the CPU; tests use it to hold a computation's working memory to its blocks.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Site = tuple[str, str]
"""Where a storage was made: ``(phase, function)``, as the ledger's ``site`` names it."""

FREED = ("before", "freed since the start")
"""The :attr:`LiveBytes.at_peak` entry of the storages made before the ledger and freed by its peak (≤ 0)."""


_OWNING_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The tensor types that own their storage: the ledger takes these among the tensors alive when it starts (a
subclass, such as a FakeTensor that ``torch.compile`` left behind, owns none and refuses its address)."""


def no_site() -> Site:
    """The default site: none (every storage in one entry)."""
    return ("", "")


class _Storage:
    """One storage the ledger holds: its bytes, where it was made, its live tensors, and whether it was
    made before the ledger (freeing it then gives its bytes back)."""

    __slots__ = ("nbytes", "site", "tensors", "before")

    def __init__(self, nbytes: int, site: Site, tensors: int = 1, before: bool = False) -> None:
        self.nbytes, self.site, self.tensors, self.before = nbytes, site, tensors, before


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made inside it that are alive (:attr:`live`), their :attr:`peak` and what
    held it (:attr:`at_peak`, bytes by site, with :data:`FREED`).

    A storage counts once however many views of it live, from the operator that made it until its last
    tensor is freed. One made before the ledger (the cache, the weights) counts against the start when its
    last tensor is freed: a buffer replaced by a larger one adds the difference, both held while the new
    one is made. A storage whose site is in ``left_out`` is not counted, nor are views of it (on a GPU,
    host memory: the repeat pass's queries).

    Args:
        site: names where the operator being dispatched was called from (called once a new storage).
        left_out: sites whose storages are not the device's.
    """

    def __init__(self, site: Callable[[], Site] = no_site, left_out: tuple[Site, ...] = ()) -> None:
        super().__init__()
        self.site, self.left_out = site, left_out
        self.storages: dict[int, _Storage] = {}
        self.live = 0
        self.peak = 0
        self.at_peak: Counter[Site] = Counter()
        # the tensors held, by id (an in-place result is its input: held once): a callback when each is freed
        self._watches: dict[int, weakref.finalize] = {}

    def __enter__(self) -> LiveBytes:
        # garbage first: a tensor in an unreachable cycle would otherwise count as alive before, and the
        # collector freeing it during the work would give back bytes the work never held
        gc.collect()
        # by exact type (_OWNING_TYPES): isinstance() reads __class__, which a dead weak proxy refuses
        alive = [held for held in gc.get_objects() if type(held) in _OWNING_TYPES]
        for held in alive:  # every tensor alive now: freeing one's storage gives its bytes back
            key = storage_key(held)
            if key and id(held) not in self._watches:
                if key not in self.storages:
                    self.storages[key] = _Storage(held.untyped_storage().nbytes(), FREED, 0, before=True)
                self.storages[key].tensors += 1
                self._hold(held, key)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        # the counts stop here: no tensor alive after (the weights, the cache) keeps a callback into the ledger
        for watch in list(self._watches.values()):
            watch.detach()
        self._watches.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        grown = False
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or id(tensor) in self._watches:
                continue
            key = storage_key(tensor)
            if key in self.storages:  # a new tensor (a view) of a counted storage
                self.storages[key].tensors += 1
                self._hold(tensor, key)
            elif key and key not in inputs:  # made here (an input's storage is left out or predates the ledger)
                site = self.site()
                if site in self.left_out:
                    continue
                nbytes = tensor.untyped_storage().nbytes()
                self.storages[key] = _Storage(nbytes, site)
                self._hold(tensor, key)
                self.live += nbytes
                grown = True
        if grown and self.live > self.peak:
            self._record_peak()
        return out

    def _record_peak(self) -> None:
        self.peak = self.live
        self.at_peak = Counter()
        for storage in self.storages.values():
            if not storage.before:
                self.at_peak[storage.site] += storage.nbytes
        freed = self.peak - sum(self.at_peak.values())
        if freed:
            self.at_peak[FREED] = freed

    def _hold(self, tensor: torch.Tensor, key: int) -> None:
        self._watches[id(tensor)] = weakref.finalize(tensor, self._release, key, id(tensor))

    def _release(self, key: int, ident: int) -> None:
        self._watches.pop(ident, None)
        storage = self.storages.get(key)
        if storage is None:
            return
        storage.tensors -= 1
        if storage.tensors == 0:
            del self.storages[key]
            self.live -= storage.nbytes


def storage_key(tensor: torch.Tensor) -> int:
    """The address of a tensor's storage (its views share it); 0 for none."""
    return tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else 0
