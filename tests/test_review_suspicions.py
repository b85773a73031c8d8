"""Review of six suspicions earlier reviewers left unproved (three proved wrong and fixed, three shown not to hold).

What this file checks:

* (a) ``load_many`` and ``max_inflight_jobs``: NOT a defect.  The bound is, as documented (config.py,
  docs/architecture.md invariant 6), the point at which a *store or load* is shed; it is checked once,
  before the load's promotes start, exactly as ``load()``/``store()``/``store_many()`` check it (all go
  through ``TierCore.begin_load``/``begin_store``), and promotes -- like spills -- are bounded by the host
  slots they each reserve, not shed by it.  The plain test pins the part that would break if the code were
  wrong: at the limit a ``load_many`` of keys only on disk is shed (``inflight_limit``) before any promote
  starts or any host slot is reserved.
* (b) PROVED, fixed (``Readers._orphaned``, ``Readers.start``): a disk reader that died and whose
  replacement could not start (``threading.Thread.start`` raising ``RuntimeError: can't start new thread``)
  left the reads queued behind it unanswered once no reader was left: a load from disk was never reported.
* (c) the vLLM ``host_bytes``/``cpu_bytes_to_use`` comparison: NOT a defect (checked in the vLLM venv, no
  test file needed): every combination (``"1073741824"`` vs ``1073741824``, ``"abc"``, a float, ``None``,
  a list) ends in a ``ConfigError`` naming the value(s); ``!=`` between JSON values never raises, and a
  string is refused by design (``test_vllm_adapter``'s ``str-host_bytes``/``str-cpu_bytes_to_use`` cases).
* (d) PROVED, fixed (``DiskStore.close``, ``CLOSE_JOIN_S``): with ``disk_io="thread"`` a disk writer hung
  in ``fdatasync`` held ``TierManager.close()`` for ever (``DiskStore.close`` joined the writer without a
  bound), where ``disk_io="process"`` bounds it by ``_CLOSE_TIMEOUT_S``.
* (e) PROVED, fixed (``Writer._reclaim``, ``SlotFile.reclaim``): a record without a parseable header that a
  reader found corrupt was deleted (``Delete(found_corrupt=True)``) but its slot was never given back until
  the next open: each such delete took a slot out of the slot file, and once the file's slots were gone
  spills failed although the index was empty.
* (f) NOT a defect: a disk writer thread that dies inside a live disk I/O process is noticed by the owner
  (``writer_alive()`` False through the child's status, ``errors_total{error="writer_died"}``), the tier
  degrades to host-only (later spills shed as ``disk_down``), and a flush sent to the child is answered
  (False) at once -- nothing waits out a timeout.  The plain test kills the child's writer through the
  child's boot line (``proc._BOOT``).

Deterministic: interleavings are forced by hooks (patched reads, a blocking ``fdatasync``, a boot line that
kills the writer); the only waits are bounded ones that detect a hang.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest

import tiered_kv.core.tiers as tiers_mod
import tiered_kv.disk.proc as proc
import tiered_kv.disk.store as store_mod
import tiered_kv.manager as manager_mod
from disk_helpers import NS, ROW, content, keys, load_ok, make_kv, metric, rig, store_one  # noqa: F401
from fakes import fake_disk_manager, fill_row, mgr_metric, on_disk_only
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import lmdb_key
from tiered_kv.disk.readers import Readers
from tiered_kv.disk.slots import SlotFile
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue

__all__ = ["rig"]


class ThreadKilled(BaseException):
    """Not an Exception: what SystemExit / an asynchronous exception looks like to a worker thread."""


def _until(pred: Any, timeout: float, mgr: Any) -> bool:
    """Poll ``mgr`` until ``pred()`` or the timeout (a bound to detect a hang, not a timing assert)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        mgr.wait(timeout=0.05)
    return True


# ============================================================================ (a) load_many vs max_inflight_jobs
@pytest.mark.disk_threads
def test_load_many_at_the_inflight_limit_is_shed_before_any_promote_starts(tmp_path: Path) -> None:
    """Invariant 6: a load is shed (``inflight_limit``) once the jobs in flight reach ``max_inflight_jobs``;
    ``load_many`` checks before its reads start, so a shed load costs no promote and no host slot."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "disk")
    try:
        ks = [b"a", b"b"]
        on_disk_only(mgr, mover, kv, ks)
        core = mgr._core
        assert core.n_in_flight[JobKind.PROMOTE] == 0
        fill_row(kv, 10, b"held")
        held = mgr.store(b"held", 10)         # one job in flight, never answered by the fake mover
        assert held is not None and mgr.jobs_in_flight == 1
        core.max_inflight = 1                 # at the limit now
        shed0 = mgr_metric(mgr, "tiered_kv_shed_total", kind="load", reason="inflight_limit")
        assert mgr.load_many(ks, [20, 21]) is None
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="load", reason="inflight_limit") == shed0 + 1
        assert core.n_in_flight[JobKind.PROMOTE] == 0 and mgr.jobs_in_flight == 1, "a shed load started reads"
        assert all(core.index.get(k) is None for k in ks), "a shed load reserved host slots"
        mover.complete(held)
        mgr.wait(timeout=10)
    finally:
        mgr.close()


# ============================================================================ (b) a reader replacement that cannot start
@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_load_from_disk_is_reported_after_the_last_reader_died_without_a_replacement(rig, monkeypatch) -> None:
    """Invariant 1 (every job reported once) and 11 (faults degrade, never hang).  Both reader threads die on
    a ``BaseException`` in their read path (each answers its read as failed), and their replacements fail to
    start (``RuntimeError: can't start new thread``, a thread or memory limit).  A later load of a block
    only on disk must still be reported (failed is fine) instead of pending for ever."""
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)   # close() with a read nobody answers: not 30 s
    monkeypatch.setattr(tiers_mod, "CLOSE_TIMEOUT_S", 1.0)
    kv = make_kv(8)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = rig.open(kv, host_slots=2, host_evict_ahead_blocks=0, disk_read_cached_in_wait=False)
    ks = keys(6)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    assert mgr.disk is not None and len(mgr.disk.readers._threads) == 2
    assert mgr.host_bytes(ks[2]) is None and mgr.lookup([ks[2]]) == 1   # only on disk

    orig_read = Readers._read
    kills = {"left": 2}

    def read(self: Readers, op: Any) -> Any:   # a lone read goes through here
        if kills["left"]:
            kills["left"] -= 1
            raise ThreadKilled("reader killed")
        return orig_read(self, op)

    orig_start = threading.Thread.start
    refused: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name == "tiered-kv-disk-reader":   # only the readers' replacements, from here on
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        orig_start(self)

    monkeypatch.setattr(Readers, "_read", read)
    monkeypatch.setattr(threading.Thread, "start", start)
    for k, row in ((ks[0], 6), (ks[1], 7)):   # each kills the reader that takes it (answered failed)
        job = mgr.load(k, row)
        assert job is not None
        mgr.wait([job], timeout=10)
        assert job.done and job.state.value == "failed", job
    assert kills["left"] == 0
    for t in list(mgr.disk.readers._threads):
        t.join(timeout=10)                     # both dying readers are gone (bounded)
    assert len(refused) == 2, refused          # ... and neither got a replacement
    job = mgr.load(ks[2], 5)
    assert job is not None, "the block is on disk"
    mgr.wait([job], timeout=5)
    reported = job.done
    monkeypatch.setattr(threading.Thread, "start", orig_start)
    mgr.close()
    assert reported, f"a load from disk is never reported once no reader is left: {job}"


# ============================================================================ (d) close() with a hung writer, thread mode
@pytest.mark.disk_threads
def test_close_returns_while_the_disk_writer_is_hung_in_fdatasync(rig, monkeypatch) -> None:
    """A hung disk (an fdatasync that does not return: a dead NFS server, a device in error recovery) with
    ``disk_io="thread"``: ``close()`` waits ``CLOSE_TIMEOUT_S`` for the spills in flight, then joins the
    writer with no bound.  ``disk_io="process"`` bounds the same close by ``_CLOSE_TIMEOUT_S``
    (docs/architecture.md, "every wait on the child is bounded ... without holding up the host")."""
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(tiers_mod, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(store_mod, "CLOSE_JOIN_S", 1.0)
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4)
    store_one(mgr, kv, b"before", 0)           # the tier works
    entered, release = threading.Event(), threading.Event()
    real_sync = SlotFile.sync

    def hung_sync(self: SlotFile) -> None:     # the writer thread's fdatasync of a batch: never returns
        entered.set()
        release.wait(120)                       # (released by the test: never hang the run)
        real_sync(self)

    monkeypatch.setattr(SlotFile, "sync", hung_sync)
    store_one(mgr, kv, b"hung", 1, flush=False)   # its write-through spill reaches the writer
    assert entered.wait(30), "the writer never reached its fdatasync"
    closer = threading.Thread(target=mgr.close, name="review-close", daemon=True)
    closer.start()
    closer.join(15)                            # CLOSE_TIMEOUT_S is 1 s: 15 s only detects a hang
    hung = closer.is_alive()
    release.set()
    closer.join(60)
    assert not hung, "TierManager.close() never returns while the disk writer is hung (disk_io='thread')"


# ============================================================================ (e) unparseable record: its slot leaks
def _store(path: Path, slots: int) -> tuple[DiskStore, CompletionQueue]:
    q = CompletionQueue()
    opts = DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=slots * ROW, durability="sync",
                       batch_blocks=slots, batch_bytes=slots * ROW, batch_seconds=0.0, slots=slots, num_readers=1)
    return DiskStore(opts, q), q


def _answer(q: CompletionQueue, seen: dict[uuid.UUID, Any], token: uuid.UUID, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while token not in seen:
        item = q.get(max(0.0, deadline - time.monotonic()))
        assert item is not None, f"no answer for {token} within {timeout} s"
        seen[item.token] = item
    return seen.pop(token)


def _flush(s: DiskStore, q: CompletionQueue, seen: dict[uuid.UUID, Any]) -> bool:
    tok = uuid.uuid4()
    s.submit_flush(tok)
    r = _answer(q, seen, tok)
    assert isinstance(r, FlushDone)
    return r.ok


def _records(s: DiskStore) -> int:
    assert s.db is not None
    s.db.rw.acquire_shared()
    try:
        with s.db.env.begin(db=s.db.blocks) as txn:
            return txn.stat(s.db.blocks)["entries"]
    finally:
        s.db.rw.release_shared()


def test_a_headerless_record_removed_by_a_reader_gives_its_slot_back(tmp_path: Path) -> None:
    """docs/architecture.md invariant 9: a corrupt record is dropped "even with no parseable header"; invariant
    12: "A slot is referenced by at most one committed entry" and a dropped entry's slot is handed out again.
    A store of 4 slots: each round writes a block, damages its index record's magic (a bit flip in a data.mdb
    page), reads it (a corrupt miss: the reader queues the record's removal) and commits the removal.  After 4
    rounds the index is empty, yet every slot stays taken and a fifth write finds no slot."""
    s, q = _store(tmp_path / "disk", slots=4)
    seen: dict[uuid.UUID, Any] = {}
    bufs: list[bytearray] = []
    try:
        for i in range(4):
            key = b"k%d" % i
            buf = bytearray(content(key, ROW).numpy().tobytes())
            bufs.append(buf)
            t = uuid.uuid4()
            assert s.submit_spill(t, key, memoryview(buf))
            assert _answer(q, seen, t).ok and _flush(s, q, seen)
            assert s.db is not None
            s.db.rw.acquire_shared()
            try:
                with s.db.env.begin(write=True, db=s.db.blocks) as txn:
                    v = bytearray(txn.get(lmdb_key(key)))
                    v[0] ^= 0xFF                                       # bad magic: no parseable header
                    txn.put(lmdb_key(key), bytes(v))
            finally:
                s.db.rw.release_shared()
            p = uuid.uuid4()
            s.queue_promote(p, key, t, memoryview(bytearray(ROW)))
            s.start_reads()
            r = _answer(q, seen, p)
            assert not r.ok and r.error.startswith("miss: corrupt"), r
            assert _flush(s, q, seen)                                  # the reader's removal is committed
            assert _records(s) == 0, "the headerless record is still in the index"
        in_use = s.slots_in_use
        t = uuid.uuid4()
        buf = bytearray(content(b"fifth", ROW).numpy().tobytes())
        bufs.append(buf)
        assert s.submit_spill(t, b"fifth", memoryview(buf))
        r = _answer(q, seen, t)
        assert in_use == 0 and r.ok, (f"an empty index, yet {in_use} of 4 slots are taken and a new write "
                                      f"fails: {r.error!r}")
    finally:
        s.close()


# ============================================================================ (f) the writer dies inside the I/O process
_KILL_WRITER = ("\nimport tiered_kv.disk.writer as _w\n"
                "def _die(self, batch):\n"
                "    raise SystemExit('disk writer killed by the test')\n"
                "_w.Writer._run_batch = _die\n")


def test_a_writer_that_dies_inside_the_disk_io_process_degrades_the_tier_and_answers_flushes(rig, monkeypatch) -> None:
    """disk_io="process" (the default).  The child's writer thread dies on its first batch while the child
    lives on: the owner sees it through the child's status (``writer_alive()`` False), counts it
    (``writer_died``), sheds later spills as ``disk_down`` (host-only), and a flush sent to the child is
    answered at once (False) -- no flush waits out its timeout, and close() is clean."""
    tail = "from tiered_kv.disk.child import child_main; child_main()"
    assert proc._BOOT.endswith(tail), proc._BOOT
    monkeypatch.setattr(proc, "_BOOT", proc._BOOT[:-len(tail)] + _KILL_WRITER + tail)
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    store = mgr.disk
    assert isinstance(store, proc.ProcessDiskStore)
    pid = store.pid
    store_one(mgr, kv, b"first", 0, flush=False)     # its spill is the writer's first batch: it dies
    assert _until(lambda: not mgr.disk.writer_alive(), 30, mgr), "the owner never saw the writer die"
    assert _until(lambda: mgr.jobs_in_flight == 0, 30, mgr), mgr.debug_sizes()
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="writer_died") == 1
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 1
    assert mgr.disk is store and store.pid == pid and store._proc.poll() is None, "the child lives on"
    # a flush that reaches the child is answered by it (the dead writer refuses it), never left to time out
    core = mgr._core
    tok = uuid.uuid4()
    core._flushes[tok] = None
    store.submit_flush(tok)
    assert _until(lambda: core._flushes[tok] is not None, 30, mgr), "a flush sent to the child is never answered"
    done: Optional[FlushDone] = core._flushes.pop(tok)
    assert done is not None and not done.ok
    assert mgr.flush(timeout=30) is False
    # host-only from now on: spills shed as disk_down, the host tier serves
    for i in range(3):
        store_one(mgr, kv, b"later%d" % i, 1 + i, flush=False)
    assert _until(lambda: mgr.jobs_in_flight == 0, 30, mgr), mgr.debug_sizes()
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down") == 3
    assert not mgr.disk_healthy
    assert load_ok(mgr, kv, b"later0", 6)
    rig.close(mgr)
