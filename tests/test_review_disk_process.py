"""Adversarial review of the disk I/O process (tiered_kv/disk/proc.py, child.py) and the batched
spill job / restart logic (tiered_kv/core/disk_tier.py, tiered_kv/core/tiers.py).

Each test forces its interleaving deterministically: SIGSTOP/SIGKILL of the child through
``kill_for_test``, the receiver held inside ``_answer_failed``, or an injected fault."""

from __future__ import annotations

import errno
import os
import signal
import threading

import pytest
import torch

from tiered_kv.disk import proc

from disk_helpers import (Rig, drain, fill, keys, load_ok, make_kv, metric, raw_keys, rig,  # noqa: F401
                          settle_restart, store_one, store_seq)

from test_disk_process import _child, _wait_down, hold_answers  # the same helpers

pytestmark = pytest.mark.timeout(120)


def _disk_only(rig: Rig, n: int, prefix: str):  # type: ignore[no-untyped-def]
    """8 host slots, 64 disk slots, ``n`` keys stored, flushed, then pushed out of the host tier."""
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    ks = keys(n, prefix)
    store_seq(mgr, kv, ks)
    for i, k in enumerate(keys(8, prefix + "-over")):
        store_one(mgr, kv, k, i % 8)
    assert all(mgr._core.index.get(k) is None for k in ks)
    assert mgr.lookup(ks) == n
    return kv, mgr, ks


# --------------------------------------------------------------------------- F1
@pytest.mark.parametrize("when", ["promote_in_flight", "promote_while_down"])
def test_a_promote_failed_by_the_io_process_death_does_not_delete_the_durable_entry(rig: Rig, when: str) -> None:
    """A durable disk entry must survive a crash of the I/O process: the death is a fault of the
    process, not of the entry.  But a promote answered ``io_process_died`` (in flight at the death, or
    started while the process is down) makes ``DiskTier.promote_reported`` remove the disk entry from
    the index, and the restart's reconciliation then deletes it from disk (on disk, not in the
    index): a process crash wipes every block the engine was reading back."""
    kv, mgr, ks = _disk_only(rig, 4, "p")
    store = _child(mgr)
    if when == "promote_in_flight":
        store.kill_for_test(signal.SIGSTOP)
        job = mgr.load(ks[0], 3)
        assert job is not None
        mgr.poll()                                   # the read goes to the stopped child
        store.kill_for_test(signal.SIGKILL)
        _wait_down(store)
    else:
        store.kill_for_test(signal.SIGKILL)
        _wait_down(store)
        # the tier is down, its index still says "on disk": the read would fail at once, the load is shed
        # (review round 34) and its entry left alone
        assert mgr.load(ks[0], 3) is None
        job = None
    if job is not None:
        got = [c for c in mgr.wait([job], timeout=30) if c.job is job]
        assert len(got) == 1 and not got[0].ok       # a miss, fine
    drain(mgr)
    assert metric(mgr, "tiered_kv_shed_total", kind="load", reason="disk_down") == (job is None)
    assert _child(mgr) is not store and not _child(mgr).down   # restarted
    assert mgr.lookup([ks[1]]) == 1                  # the entries nobody read survived the crash ...
    assert mgr.lookup([ks[0]]) == 1, "the entry being read when the I/O process died was dropped"
    assert load_ok(mgr, kv, ks[0], 3)


# --------------------------------------------------------------------------- F2
def test_an_os_error_starting_the_restarted_child_is_counted_not_raised_from_poll(rig: Rig,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """"Faults degrade, never raise": a restart that fails is counted (``io_process_restart_failed``)
    and retried after a back-off.  ``ProcessDiskStore._start`` turns only the spawn's OSError into a
    ``ProcessStartError``; an OSError from ``os.pipe()`` (EMFILE: the process is out of descriptors)
    escapes ``DiskTier.restart`` (which catches DiskTierError/DiskInUseError only) and ``poll()``."""
    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    store = _child(mgr)
    store.kill_for_test(signal.SIGKILL)
    _wait_down(store)

    class _NoFds:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(os, name)

        @staticmethod
        def pipe():  # type: ignore[no-untyped-def]
            raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(proc, "os", _NoFds())        # only proc.py's calls see it
    try:
        mgr.poll()                                   # the pass that restarts the child
        settle_restart(mgr)                          # (its start runs on a starter thread)
    finally:
        monkeypatch.undo()
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_process_restart_failed") == 1
    assert not mgr._core.disk.usable


# --------------------------------------------------------------------------- F3
def test_a_spill_while_the_dead_childs_ops_are_being_answered_is_shed_as_disk_down_without_evicting(
        rig: Rig) -> None:
    """Between ``_dead`` (the receiver took the outstanding ops) and ``down`` (their answers queued),
    ``spill_room()`` still reports room, so ``DiskTier.start_spills`` reserves a disk entry -- evicting
    a READY one from a full tier -- before ``submit_spills`` refuses (``_track`` is False); the spill
    is then shed as ``backpressure``.  The contract: a spill to a dead process is shed as
    ``disk_down`` and "a shed spill never costs an eviction"."""
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=16, disk_slots=4)    # a toy tier: 4 index blocks
    ks = keys(4, "full")
    store_seq(mgr, kv, ks)
    dix = mgr._core.dindex
    assert all(dix.ready(k) is not None for k in ks) and len(dix) == 4
    store = _child(mgr)
    held, go = hold_answers(store)
    store.kill_for_test(signal.SIGKILL)
    try:
        assert held.wait(30)
        assert store._dead and not store.down
        fill(kv, 5, b"late")
        job = mgr.store(b"late", 5)
        assert job is not None
        mgr.wait([job], timeout=30)                  # the host copy lands; its write-through spill is tried
        shed_bp = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure")
        shed_down = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down")
        still = [k for k in ks if k in dix]
    finally:
        go.set()
    _wait_down(store)
    drain(mgr)
    assert (shed_bp, shed_down, still) == (0, 1, ks), \
        f"shed as backpressure={shed_bp}, disk_down={shed_down}; on disk after the shed spill: {still}"


# --------------------------------------------------------------------------- F4
def test_close_of_a_child_that_stopped_reading_is_bounded_by_the_close_timeout(rig: Rig,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` "lets the child finish what was sent ... waits ``_CLOSE_TIMEOUT_S`` for the child to
    drain, then kills it".  But it first turns the command pipe blocking and writes the whole backlog
    (``ProcessDiskStore.close`` -> ``kick``): with a child that no longer reads (stopped here; a
    command thread stuck in a lone read on a hung disk alike) and a backlog over the pipe's size, the
    write blocks for ever and the timeout never starts -- the host's shutdown hangs."""
    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    store = _child(mgr)
    monkeypatch.setattr(proc, "_CLOSE_TIMEOUT_S", 1.0)
    store.kill_for_test(signal.SIGSTOP)
    closer = None
    try:
        big = b"x" * 900
        for i in range(3000):                        # ~3 MB of touches: past any pipe buffer
            store.submit_touch(big + b"%d" % i)
        store.kick()
        assert len(store._backlog) > 0
        closer = threading.Thread(target=store.close, daemon=True)
        closer.start()
        closer.join(10)                              # 10x the (patched) close timeout
        hung = closer.is_alive()
    finally:
        if store.pid and not store.down:
            try:
                store.kill_for_test(signal.SIGKILL)  # let a hung close() go (its write fails)
            except ProcessLookupError:
                pass
        if closer is not None:
            closer.join(30)
    assert not hung, "close() blocked writing the backlog to a child that does not read"


# --------------------------------------------------------------------------- F5
def test_write_back_retries_a_spill_that_the_io_process_death_failed(rig: Rig) -> None:
    """Write-back offers each host residency once (``Entry.spilled``, set by ``TierCore.start_spills``
    for every entry it tried).  A spill that *failed* (here: answered ``io_process_died``; an I/O
    error of its batch alike) leaves the block on the host only, but ``spilled`` stays True
    (``_apply_spill``/``DiskTier.finish_spill`` never reset it), so write-back never writes it again:
    the block is lost when the host evicts it, although the disk tier is back and idle."""
    kv = make_kv(rows=16)
    mgr = rig.open(kv, host_slots=16, disk_slots=64, write_mode="back", host_evict_ahead_blocks=0)
    store = _child(mgr)
    store.kill_for_test(signal.SIGSTOP)              # the write-back spills go out, never answered
    try:
        ks = keys(12, "wb")                          # 12 of 16 host slots: past the 3/4 mark
        jobs = []
        for i, k in enumerate(ks):
            fill(kv, i, k)
            jobs.append(mgr.store(k, i))
            assert jobs[-1] is not None
        mgr.wait(jobs, timeout=30)
        assert all(j.done for j in jobs)
        for _ in range(3):
            mgr.poll()                               # write-back: the coldest go to the stopped child
        assert store.queue_depth > 0
    finally:
        store.kill_for_test(signal.SIGKILL)
    _wait_down(store)
    drain(mgr)
    assert _child(mgr) is not store and mgr._core.disk.usable
    for _ in range(3):                               # idle passes: write-back has room and time
        mgr.poll()
    assert mgr.flush(timeout=30) is True
    drain(mgr)
    dix = mgr._core.dindex
    missing = [k for k in ks if dix.ready(k) is None]
    assert missing == [], f"never written again after the failed spill: {missing}"


# --------------------------------------------------------------------------- a death noticed while closing
def test_a_child_that_died_before_close_is_counted_even_if_close_starts_first(rig: Rig) -> None:
    """The receiver notices a death when the child's pipe ends; ``close()`` may begin in between (it
    sets ``_closing``).  The death is still counted (``io_process_died``): only a child that said it
    closed is a clean exit.  Forced: the receiver is held in its wait for the child's exit status
    until ``close()`` has begun."""
    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    store = _child(mgr)
    in_wait, closing = threading.Event(), threading.Event()
    proc_wait = store._proc.wait

    def held_wait(*a, **k):  # type: ignore[no-untyped-def]
        in_wait.set()
        assert closing.wait(30)
        return proc_wait(*a, **k)

    store._proc.wait = held_wait  # type: ignore[method-assign]
    store.kill_for_test(signal.SIGKILL)
    assert in_wait.wait(30)
    real_kick = store.kick

    def kick_then_let_go() -> None:   # close() has set _closing before its first kick
        closing.set()
        real_kick()

    store.kick = kick_then_let_go  # type: ignore[method-assign]
    store.close()
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_process_died") == 1
