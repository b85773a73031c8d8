"""Review of the page-cache reads a blocked wait() does itself (tiered_kv/disk/cached.py, the
``cached_here`` paths of DiskStore/ProcessDiskStore.start_reads, TierCore.read_here).

What it proved wrong (each test failed on the code as first written):

* the disk I/O process's store emptied its held reads before the page-cache reads ran: an interrupt
  in one (a KeyboardInterrupt, a SIGTERM handler's SystemExit) lost every read held, whose loads then
  pended until close() gave up on them;
* ``wait(timeout=...)`` read every held block the page cache had, however long that took: no read
  may start past the call's deadline;
* a relative ``disk_path`` was opened lazily relative to the working directory of the first read:
  after a chdir no read was served here (or another directory's slot file was opened);
* the architecture page's lock table had lost two rows to the new module's row.

The other tests are regression checks of edge cases found correct.  Orderings are forced with fake
functions (``cached._PREADV``) and a fake clock, never with sleeps.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import tiered_kv.manager as manager_mod
from tiered_kv.disk import cached as cached_mod

from disk_helpers import (Rig, disk_only_keys, keys, load_ok, make_kv, restart_disk_process, rig, row_is,  # noqa: F401
                          store_one, store_seq)

pytestmark = pytest.mark.timeout(120)

IO = ["process", "thread"]
REPO = Path(__file__).resolve().parent.parent


def _interrupt_first_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first page-cache read raises KeyboardInterrupt -- what os.preadv raises when SIGINT (Ctrl-C, or a
    host's SIGTERM handler raising) arrives during the call -- later ones read for real."""
    real = cached_mod._PREADV
    calls: list[int] = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        calls.append(off)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(fd, bufs, off, flags)

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    return calls


# ---------------------------------------------------------------------------------------------- an interrupt
def test_process_an_interrupted_page_cache_read_loses_no_held_read(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt inside a page-cache read leaves every read held, so the next pass serves or sends it."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    calls = _interrupt_first_read(monkeypatch)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)   # teardown: close() must not wait 30 s for the lost read
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert len(calls) == 1
        # the host catches the interrupt and goes on (or shuts down): the held reads must still be answered
        mgr.wait(jobs, timeout=5)
        assert all(j.done for j in jobs), ("a load whose read was held when the interrupt came is never reported: "
                                           f"{[j.state.name for j in jobs]}, child ops outstanding "
                                           f"{len(mgr.disk._outstanding)}, held {len(mgr.disk._held)}")
        assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    finally:
        rig.close(mgr)


def test_process_an_interrupt_while_served_reads_are_queued_answers_each_at_least_once(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt inside the queueing of reads served here (after the first report went on the
    queue): every read is still answered, the one queued twice counted stale once, none left pending."""
    from disk_helpers import metric_sum

    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    store = mgr.disk
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    real = store._out.put_many
    fired = []

    def put_then_interrupt(items):  # type: ignore[no-untyped-def]
        if not fired and len(items) == 2:
            fired.append(1)
            store._out.put(items[0])
            raise KeyboardInterrupt
        return real(items)

    monkeypatch.setattr(store._out, "put_many", put_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait(jobs, timeout=30)
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert metric_sum(mgr, "tiered_kv_stale_callbacks_total", kind="promote", reason="unknown_token") == 1


def test_thread_an_interrupted_page_cache_read_loses_no_held_read(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (correct today): the in-process store keeps the held reads when CachedReads.read raises
    (``served, self._held_reads = cached.read(held)`` assigns only on return); the readers answer them."""
    kv, mgr, ks = disk_only_keys(rig, "thread", n=2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    _interrupt_first_read(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait(jobs, timeout=30)
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))


# ---------------------------------------------------------------------------------------------- the deadline
@pytest.mark.parametrize("io", IO)
def test_a_wait_does_not_read_the_page_cache_past_its_deadline(rig: Rig, io: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No page-cache read starts past the blocked call's deadline (a fake clock: one second a read)."""
    kv, mgr, ks = disk_only_keys(rig, io, n=4)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    real_mono = time.monotonic
    skew = [0.0]
    real = cached_mod._PREADV
    started: list[float] = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        started.append(time.monotonic())
        skew[0] += 1.0           # a (large) block's page-cache copy: one second of the process's clock
        return real(fd, bufs, off, flags)

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + skew[0])
    t0 = time.monotonic()
    mgr.wait(jobs, timeout=0.9)
    monkeypatch.undo()
    mgr.wait(jobs, timeout=30)   # every load completes either way
    assert all(j.state.name == "DONE" for j in jobs) and all(row_is(kv, i, k) for i, k in enumerate(ks))
    late = [round(t - t0, 1) for t in started if t >= t0 + 0.9]
    assert late == [], f"page-cache reads started {late} s into a wait(timeout=0.9)"


# ---------------------------------------------------------------------------------------------- a relative disk_path
@pytest.mark.parametrize("io", IO)
def test_a_relative_disk_path_still_serves_page_cache_reads_after_a_chdir(
        rig: Rig, io: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The slot file of a relative ``disk_path`` is the one it named when the tier opened."""
    monkeypatch.chdir(tmp_path)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, path="rel-disk", host_slots=8, disk_slots=64, disk_io=io)
    try:
        ks = keys(1, "rel")
        store_seq(mgr, kv, ks)
        for i, k in enumerate(keys(8, "rel-over")):
            store_one(mgr, kv, k, i % 8)
        assert mgr.host_bytes(ks[0]) is None
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)   # the host moves on (a worker's chdir); the tier stays where it was opened
        assert load_ok(mgr, kv, ks[0], 0)
        assert mgr.disk.cached.served == 1, "the page-cache read looked for the slot file under the new cwd"
    finally:
        monkeypatch.chdir(tmp_path)
        rig.close(mgr)


# ---------------------------------------------------------------------------------------------- the architecture page
def test_the_architecture_lock_table_rows_are_well_formed() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("| lock or queue | where | guards |")
    rows = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    bad = [r for r in rows if len(re.findall(r"(?<!\\)\|", r)) != 4]
    assert bad == [], f"rows without 3 cells: {bad}"
    for name in ("`Readers._reads`", "`Readers._lock`"):
        row = next(r for r in rows if r.startswith(f"| {name}"))
        assert "`disk/readers.py`" in row and "CachedReads" not in row, row


# ---------------------------------------------------------------------------------------------- checked: correct
def test_a_restarted_disk_process_leaves_each_kept_entrys_record_right(rig: Rig) -> None:
    """Regression (correct today): the owner's ``where`` of an entry kept across a restart of the disk
    I/O process equals what the new process recovered, and the blocks are served here after it."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    before = {k: mgr._core.dindex.ready(k).where for k in ks}
    restart_disk_process(mgr)
    recovered = {e.key: e.where for e in mgr.disk.entries}
    for k in ks:
        assert mgr._core.dindex.ready(k).where == before[k] == recovered[k]
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i)
    assert mgr.disk.cached.served == len(ks)


@pytest.mark.parametrize("io", IO)
def test_no_descriptor_is_left_open_by_the_page_cache_reads(rig: Rig, io: str) -> None:
    """Regression (correct today): the slot file the owner opened for its page-cache reads is closed by
    close() in both modes."""
    def slot_fds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").endswith("slots.tkv"):
                    n += 1
            except OSError:
                pass
        return n

    base = slot_fds()
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i)
    assert mgr.disk.cached.served == 2
    rig.close(mgr)
    assert slot_fds() == base
