"""Round 10 adversarial review: crash consistency of the disk tier (disk/, core/disk_tier.py, recovery at open).

What it proved wrong (each fixed; the tests below fail without the fix):

1. close() did not reconcile after a disk I/O process that died *during* close: a key invalidated just
   before close() (its tomb sent, never committed) was served again after the reopen.  Fixed:
   ``TierCore.close_disk`` looks again after the store's close, and a child that died on its own
   (``ProcessDiskStore.died``: not killed for outlasting the close) gets one more start to reconcile.
2. The path lock was released while a dead disk I/O process was replaced (and for the whole back-off after a
   failed start): a second store opened the path while its owner was alive.  Fixed: the disk tier keeps a
   share of the lock (``lock.share``) from its open to its close (``DiskTier.leave_path``); each store of
   the disk I/O process closes its own share without unlocking.

Checked and found to hold (plain tests here): a child SIGKILLed inside the LMDB write transaction that would
publish a spill publishes nothing, and its successor opens (LMDB's robust writer lock) and writes on; seeded runs
with a child SIGKILL at a seeded step never serve wrong bytes and never bring an invalidated key back after a
clean close and reopen (restart adoption's reconciliation).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from disk_helpers import (Rig, keys, load_ok, make_kv, metric, raw_keys, rig, store_seq)  # noqa: F401
from tiered_kv.disk.proc import ProcessDiskStore
from tiered_kv.errors import DiskInUseError

pytestmark = pytest.mark.timeout(60)

__all__ = ["rig"]


def _child(mgr) -> ProcessDiskStore:  # type: ignore[no-untyped-def]
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore), type(store)
    return store


def _wait(pred, timeout: float = 20.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    """Poll a condition another process or thread makes true (a bounded wait, never an ordering sleep)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# =========================================================================== finding 1
def test_a_key_invalidated_before_close_stays_gone_when_the_child_dies_during_close(rig: Rig) -> None:
    """Contract (docs/architecture.md, "The disk I/O process"; DiskTier.restart's docstring): after a disk I/O
    process dies, what it recovered is reconciled with the index -- "one on disk that the index no longer holds
    (invalidated, evicted, or deleted by an op the dead process never committed) is deleted, token-matched --
    nothing the owner dropped comes back" --, and ``close()`` on a tier whose child died starts one more child
    to reconcile, "so that the next open does not find it".

    What it proved wrong: ``TierCore.close_disk`` looked for a dead child only *before* ``disk.store.close()``.
    A child that died while close() drained it (here: SIGKILLed once close() reached the store, with the
    invalidation's tomb still unread in its pipe) was answered by the receiver (``ProcessDiskStore._gone``)
    and counted, but nothing reconciled: close() returned normally,    the key's entry was still on disk under the token the owner invalidated, and the next open served it.
    Fixed: close_disk looks again after the store's close (``DiskTier.died``) and starts one more child.
    """
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    ks = keys(3, "r10close")
    store_seq(mgr, kv, ks)                           # each durable on disk (flush() True)
    store = _child(mgr)
    path = mgr.config.disk_dir
    store.kill_for_test(signal.SIGSTOP)              # the child reads nothing from here on
    mgr.invalidate(ks[1])                            # its tomb goes down the pipe, unread
    mgr.poll()
    real_close = store.close

    killed: list[bool] = []

    def close_as_the_child_dies() -> None:           # the child is killed (OOM killer, operator) while closing
        if not killed:                               # (the close is idempotent: called again, it only closes)
            killed.append(True)
            store.kill_for_test(signal.SIGKILL)
            _wait(lambda: store.down, what="the receiver to answer the dead child's ops")
        real_close()

    store.close = close_as_the_child_dies  # type: ignore[method-assign]
    rig.close(mgr)
    mgr2 = rig.open(make_kv(rows=8), host_slots=8, disk_slots=64)
    assert mgr2.lookup([ks[0]]) == 1                 # what was not invalidated survived
    assert mgr2.lookup([ks[1]]) == 0, "a key invalidated before close() is served again after the reopen"
    del path


# =========================================================================== finding 2
def _second_store_on(mgr) -> str:  # type: ignore[no-untyped-def]
    """Open (and close at once) a thread-mode store on ``mgr``'s path: "opened", or "refused" (DiskInUseError)."""
    from tiered_kv.disk import DiskStore
    from tiered_kv.movers import CompletionQueue

    try:
        other = DiskStore(mgr.disk.opts, CompletionQueue())
    except DiskInUseError:
        return "refused"
    other.close()
    return "opened"


@pytest.mark.parametrize("start_fails", [False, True], ids=["restart", "failed_restart"])
def test_no_second_store_opens_the_path_while_the_owner_replaces_its_dead_io_process(rig: Rig,
                                                                                    start_fails: bool) -> None:
    """Contract (docs/architecture.md invariant 16, "One owner per disk path"): "A second store on the same path,
    in this process or another, and a writing operator tool while a store holds it, are refused"; with the disk
    I/O process "the path is free only once both [the owner and its child] are gone".

    What it proved wrong: ``DiskTier.restart`` called ``self.store.close()`` on the dead ``ProcessDiskStore``,
    whose ``_release`` unlocked the owner's own path lock.  The replacement took a new lock only when the starter
    thread reached ``take_path``; a start that failed released that one too, and the tier then waited out a
    back-off of 1 s to 60 s (``_failed_start``) with no lock at all.  Meanwhile the owner was alive and kept an
    index of the path (keys it dropped while no child ran are still on disk, to be deleted only at adoption):
    another manager, or a writing operator tool (compact, verify --repair, import), opened the path.  ``restart``:
    probed from inside the replacement's start (after the old store's close, before the new take);
    ``failed_restart``: the first start fails, probed during the back-off.  Fixed: the tier keeps a share of the
    lock (``lock.share``) for its life; the stores close theirs without unlocking.
    """
    from tiered_kv.errors import DiskTierError

    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    store_seq(mgr, kv, keys(2, "r10lock"))
    tier = mgr._core.disk
    real_reopen = tier._reopen
    seen: list[str] = []
    starts = [0]

    def reopen():  # type: ignore[no-untyped-def]
        starts[0] += 1
        if start_fails and starts[0] == 1:
            raise DiskTierError("injected: the new disk I/O process could not open")
        if not start_fails:   # after the dead store was closed, before the new one takes the path
            seen.append(_second_store_on(mgr))
        return real_reopen()

    tier._reopen = reopen
    old = _child(mgr)
    old.kill_for_test(signal.SIGKILL)
    _wait(lambda: old.down, what="the dead child's answers")
    deadline = time.monotonic() + 30
    if start_fails:
        while starts[0] < 1 or tier._starting is not None:
            mgr.wait(timeout=0.02)
            assert time.monotonic() < deadline, "no restart was tried"
        assert tier.down and mgr.disk is old          # the tier waits out its back-off, its owner alive
        seen.append(_second_store_on(mgr))
    while mgr.disk is old or tier._starting is not None:
        mgr.wait(timeout=0.02)
        assert time.monotonic() < deadline, "the disk I/O process was not restarted"
    assert seen == ["refused"], f"a second store opened the path while its owner replaced its I/O process: {seen}"


# =========================================================================== checked and found to hold
_KILL_IN_TXN = ("\nimport os, signal, tiered_kv.disk.tombs as _t\n"
                "_prevents = _t.Tombs.prevents\n"
                "def _die_in_txn(self, txn, token, undo):\n"
                "    if os.path.exists(os.environ['R10_ARM']):\n"
                "        os.kill(os.getpid(), signal.SIGKILL)\n"
                "    return _prevents(self, txn, token, undo)\n"
                "_t.Tombs.prevents = _die_in_txn\n")


def test_a_child_killed_inside_the_write_transaction_publishes_nothing_and_its_successor_writes_on(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The disk I/O process is SIGKILLed inside the LMDB write transaction that would publish a spill (LMDB's
    writer mutex held, its slot written and synced): the restarted child opens (LMDB's robust lock recovers), the
    interrupted spill is answered failed and is on disk under no record, the keys flushed before stay, and later
    spills and flushes succeed -- also after a reopen."""
    import tiered_kv.disk.proc as proc
    from disk_helpers import fill

    arm = tmp_path / "arm"
    monkeypatch.setenv("R10_ARM", str(arm))
    tail = "from tiered_kv.disk.child import child_main; child_main()"
    assert proc._BOOT.endswith(tail), proc._BOOT
    monkeypatch.setattr(proc, "_BOOT", proc._BOOT[:-len(tail)] + _KILL_IN_TXN + tail)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    ks = keys(4, "r10txn")
    store_seq(mgr, kv, ks[:2])
    old = _child(mgr)
    arm.write_text("armed")                          # the next spill's transaction kills the child
    fill(kv, 2, ks[2])
    job = mgr.store(ks[2], 2)
    assert job is not None
    mgr.wait([job], timeout=10)
    deadline = time.monotonic() + 30
    while not old.down:
        mgr.wait(timeout=0.02)
        assert time.monotonic() < deadline, "the child did not die in its transaction"
    arm.unlink()
    while mgr.disk is old or mgr._core.disk._starting is not None:
        mgr.wait(timeout=0.02)
        assert time.monotonic() < deadline, "the disk I/O process was not restarted"
    assert mgr.flush(timeout=10) is True
    store_seq(mgr, kv, [ks[3]])                      # the successor writes on
    path = mgr.config.disk_dir
    rig.close(mgr)
    on_disk = raw_keys(path)
    assert {ks[0], ks[1], ks[3]} <= on_disk and ks[2] not in on_disk, on_disk
    kv2 = make_kv(rows=8)
    mgr2 = rig.open(kv2, host_slots=8, disk_slots=64)
    for i, k in enumerate((ks[0], ks[1], ks[3])):
        assert load_ok(mgr2, kv2, k, i), f"{k!r}, flushed, is not served after the reopen"
    assert mgr2.lookup([ks[2]]) == 0


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_seeded_child_kills_never_bring_back_an_invalidated_key_nor_serve_wrong_bytes(rig: Rig, seed: int) -> None:
    """A seeded run of stores, invalidations, loads, polls and flushes, with the disk I/O process SIGKILLed at a
    seeded step (and invalidations while it is dead or restarting); after a clean close and a reopen no key whose
    last operation was an invalidation is found, and every load that reports ok carries its key's bytes."""
    import random

    from disk_helpers import fill, row_is

    rng = random.Random(seed)
    kv = make_kv(rows=12)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, writer_batch_blocks=4, writer_batch_seconds=0.002)
    ks = keys(20, "r10fz")
    last: dict[bytes, str] = {}
    kill_at = rng.randrange(40, 160)
    row = 0
    for step in range(240):
        if step == kill_at:
            _child(mgr).kill_for_test(signal.SIGKILL)
        r, key = rng.random(), rng.choice(ks)
        if r < 0.4:
            row = (row + 1) % 8
            assert mgr.free_block(row)
            fill(kv, row, key)
            if mgr.store(key, row) is not None:
                last[key] = "stored"
        elif r < 0.6:
            mgr.invalidate(key)
            last[key] = "invalidated"
        elif r < 0.7:
            dst = 8 + rng.randrange(4)
            job = mgr.load(key, dst)
            if job is not None:
                for c in mgr.wait([job], timeout=30):
                    if c.job is job and c.ok:
                        assert row_is(kv, dst, key), f"wrong bytes served for {key!r}"
        elif r < 0.95:
            mgr.wait(timeout=0.002) if rng.random() < 0.5 else mgr.poll()
        else:
            mgr.flush(timeout=10)
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_process_died") == 1
    rig.close(mgr)
    mgr2 = rig.open(make_kv(rows=12), host_slots=8, disk_slots=64)
    back = [k for k, s in last.items() if s == "invalidated" and mgr2.lookup([k])]
    assert not back, f"invalidated keys back after the reopen: {back}"
