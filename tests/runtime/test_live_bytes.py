"""kvfold.runtime.live_bytes: the bytes a stretch of work makes and holds, and its peak."""

from __future__ import annotations

import gc
import weakref

import torch

from kvfold.runtime.live_bytes import FREED, LiveBytes


def test_a_storage_counts_once_from_its_making_until_its_last_tensor_is_freed():
    """Views and in-place results add nothing; the bytes are given back when the last view goes."""
    with torch.inference_mode(), LiveBytes() as ledger:
        a = torch.zeros(1000)  # 4,000 bytes
        view = a[10:20].view(2, 5)
        a.add_(1)
        b = torch.ones(250, dtype=torch.float64)  # 2,000 bytes
        assert ledger.live == 6000
        del a
        assert ledger.live == 6000  # the view keeps the storage
        del view
        assert ledger.live == 2000
        c = b * 2
        del b, c
        assert ledger.live == 0
    assert ledger.peak == 6000


def test_the_peak_says_what_held_it_and_gives_back_what_existed_before():
    """A buffer made before the ledger and replaced by a larger one inside it adds the difference, both held
    while the new one is made; a tensor alive throughout counts nothing."""
    held = {"buffer": torch.zeros(100), "kept": torch.zeros(25)}  # 400 and 100 bytes, made before
    sites = iter([("phase", "first"), ("phase", "second")])
    with torch.inference_mode(), LiveBytes(site=lambda: next(sites)) as ledger:
        held["buffer"] = torch.zeros(300)  # 1,200 bytes, then the old 400 freed
        assert (ledger.live, ledger.peak) == (800, 1200)
        extra = torch.zeros(200)  # 800 bytes: a new peak
    assert ledger.peak == 1600 and extra.numel() == 200
    assert ledger.at_peak == {("phase", "first"): 1200, ("phase", "second"): 800, FREED: -400}


def test_storages_made_at_a_site_left_out_and_their_views_count_nothing():
    """On a GPU the repeat pass's queries are host memory: their site is left out."""
    sites = iter([("repeat", "host"), ("repeat", "device")])
    with torch.inference_mode(), LiveBytes(site=lambda: next(sites), left_out=(("repeat", "host"),)) as ledger:
        host = torch.zeros(50)
        rows = host.view(5, 10)  # a view: no site asked
        device = torch.zeros(10)
    assert rows.numel() == 50 and device.numel() == 10
    assert ledger.peak == 40 and ledger.at_peak == {("repeat", "device"): 40}


def test_a_dead_weak_proxy_among_the_live_objects_does_not_stop_the_ledger():
    """The ledger looks at every object the garbage collector tracks; a weak proxy whose object is gone refuses
    ``isinstance`` (a ``ReferenceError``), so it is told apart by its type."""

    class Held:
        pass

    held = Held()
    proxies = [weakref.proxy(held)]
    del held
    with torch.inference_mode(), LiveBytes() as ledger:
        made = torch.zeros(10)
    assert ledger.peak == 40 and made.numel() == 10 and len(proxies) == 1


def test_tensors_torch_compile_left_behind_do_not_stop_the_ledger():
    """``torch.compile`` leaves fake tensors alive whose storage refuses to give its address (seen in the suite:
    a test compiled before the ledger ran); they own no memory, so the ledger passes them by."""
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    compiled(torch.ones(4))
    with torch.inference_mode(), LiveBytes() as ledger:
        made = torch.zeros(10)
    assert ledger.peak == 40 and made.numel() == 10


def test_garbage_from_before_is_not_given_back_during_the_work():
    """A tensor in an unreachable cycle (left by earlier work) is collected before the ledger starts, not
    during the work, where its bytes would count against what the work holds (seen in the suite: live < 0)."""

    class Cycle:
        pass

    garbage = Cycle()
    garbage.self, garbage.tensor = garbage, torch.zeros(100_000)
    del garbage
    with torch.inference_mode(), LiveBytes() as ledger:
        made = torch.zeros(10)
        gc.collect()
        assert ledger.live == 40
    assert ledger.peak == 40 and made.numel() == 10


def test_the_counts_stop_when_the_ledger_is_left():
    """Leaving the ledger detaches it from every tensor it watched: those alive before and after keep no
    callback into it (a process that counts many times would pile them up on its weights)."""
    kept = torch.zeros(100)
    with torch.inference_mode(), LiveBytes() as ledger:
        made = torch.zeros(10)
    del made, kept  # freed after leaving: no callback reaches the ledger
    assert (ledger.live, ledger.peak) == (40, 40)  # the counts as they were on leaving
