"""Orderings of the disk tier that only a held thread or a recorded call sequence can show (issue 21).

* A promote pins its disk entry (``TierCore.start_promote`` -> ``TierIndex.pin``, released in
  ``TierCore._promote_reported``): while its read is in flight, disk eviction must take other entries,
  and the entry's slot in the slot file must not be handed to another key.  The read is held by a
  stand-in for the readers' slot file between the read's index lookup and its ``preadv`` (the
  window where a reused slot would be read), released by an event: no sleeps.
* The writer makes a batch's slot bytes durable (``fdatasync`` of ``slots.tkv``) before the LMDB
  commit that publishes index records pointing at them, for every durability level that promises
  durability.  A SIGKILL cannot show this (the page cache survives a process kill), so the calls
  themselves are recorded, in order, at the OS and LMDB boundaries.

Deterministic: seeded tensors, ``tmp_path``, events and a writer gate for every ordering; the
bounded waits below only keep a broken run from hanging.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import pytest

from disk_helpers import WriterGate
from fakes import ROW_BYTES, make_config, make_fake_manager, make_kv, mgr_metric, row_matches, stored
from tiered_kv.disk.format import lmdb_key, parse_header
from tiered_kv.jobs import JobKind

BOUND_S = 120.0
"""Upper bound of any wait for another thread: a broken run fails instead of hanging (never an ordering)."""


# =========================================================================== promote vs. disk eviction
class _ReadHeldAtSlotFile:
    """Stands in for the readers' :class:`SlotFile`.  A lone read takes ``fd`` after its index lookup,
    right before its ``preadv``: the first such access sets ``reached`` and waits for ``go``."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.reached = threading.Event()
        self.go = threading.Event()

    @property
    def fd(self) -> int:
        if not self.reached.is_set():
            self.reached.set()
            self.go.wait(BOUND_S)
        return self._real.fd

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.disk_threads
def test_a_promote_in_flight_keeps_its_disk_entry_and_slot_under_eviction_pressure(tmp_path):
    """Guards the promote's pin on its disk entry (``TierCore.start_promote``: ``disk.index.pin(d, ...)``,
    released in ``_promote_reported``).

    Key A is on disk only; ``load(A)`` starts a promote whose real read is held after it looked A up
    (it knows A's slot) and before it reads the slot.  Meanwhile 16 more blocks are spilled into an
    8-block disk tier: every other entry is evicted, their slots freed and reused.  A must stay in the
    disk index, A's slot must not be allocated to another write while the read holds it, and once the
    read goes on the load must deliver A's exact bytes.  Without the pin A is evicted, its slot goes
    to another key, and the load fails (the reader sees the bytes changed under it)."""
    A = b"promoted-key"
    kv = make_kv(64)
    cfg = make_config(host_slots=4, disk_path=tmp_path / "d", disk_capacity_bytes=8 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0)
    mgr, mover = make_fake_manager(cfg, kv)
    store = mgr.disk
    hold: Optional[_ReadHeldAtSlotFile] = None
    try:
        stored(mgr, mover, kv, [A], [0])
        assert mgr.flush(timeout=BOUND_S)
        for i in range(4):                           # push A out of the 4-slot host tier
            stored(mgr, mover, kv, [f"filler-{i}".encode()], [1])
            assert mgr.flush(timeout=BOUND_S)
        assert mgr.host_bytes(A) is None and mgr.lookup([A]) == 1, "A should be on disk only"
        with store.db.env.begin(db=store.db.blocks) as txn:
            slot_a = parse_header(bytes(txn.get(lmdb_key(A)))).slot

        # record every slot the writer allocates, and the lookups of the held read
        slots = store.slots
        allocs: list[int] = []
        real_alloc = slots.alloc

        def alloc() -> int:
            s = real_alloc()
            allocs.append(s)
            return s

        slots.alloc = alloc   # the instance attribute shadows the method (the writer calls slots.alloc())
        readers = store.readers
        lookups: list[Any] = []
        real_lookup = readers._lookup

        def lookup(txn: Any, op: Any, t0: float) -> Any:
            found = real_lookup(txn, op, t0)
            lookups.append((op.key, found))
            return found

        readers._lookup = lookup
        hold = _ReadHeldAtSlotFile(readers._slots)
        readers._slots = hold
        landed = threading.Event()                   # the promote's report is on the completion queue
        out = readers._out
        real_put = out.put

        def put(item: Any) -> None:
            real_put(item)
            if getattr(item, "kind", None) is JobKind.PROMOTE:
                landed.set()

        out.put = put

        job = mgr.load(A, 50)
        assert job is not None and not mover.is_outstanding(job), "the load should wait for a read from disk"
        mgr.poll()                                   # hands the held read to a reader thread
        assert hold.reached.wait(BOUND_S), "the promote's read never reached the slot file"
        assert len(lookups) == 1 and lookups[0][0] == A and not hasattr(lookups[0][1], "ok"), \
            f"the held read should have found A's index record before its preadv: {lookups}"

        # eviction pressure on the disk tier while the read is held
        evicted_before = mgr_metric(mgr, "tiered_kv_evictions_total", tier="disk")
        allocs_before = len(allocs)
        for i in range(16):
            stored(mgr, mover, kv, [f"pressure-{i:02d}".encode()], [2])
            assert mgr.flush(timeout=BOUND_S)
        evicted = mgr_metric(mgr, "tiered_kv_evictions_total", tier="disk") - evicted_before
        assert evicted >= 8, f"only {evicted} disk evictions: the pressure test did not pressure"
        allocated_while_held = allocs[allocs_before:]
        d = mgr._core.dindex.get(A)
        a_in_index = d is not None and d.live
        assert not landed.is_set() and not job.done, "the read was not held"

        hold.go.set()
        assert landed.wait(BOUND_S), "the promote's read was never answered"
        got = [c for c in mgr.poll() if c.job is job]
        if mover.is_outstanding(job):                # the read landed: the load's copy was queued
            mover.complete(job)
            got += [c for c in mgr.poll() if c.job is job]

        problems = []
        if len(got) != 1 or not got[0].ok:
            problems.append(f"the load of A was not delivered ok once: {[(c.ok, c.error) for c in got]}")
        elif not row_matches(kv, 50, A):
            problems.append("the load of A reported ok with WRONG BYTES")
        if not a_in_index:
            problems.append(f"A left the disk index while its promote's read was in flight (entry {d!r})")
        if slot_a in allocated_while_held:
            problems.append(f"A's slot {slot_a} was allocated to another write while A's read held it "
                            f"(allocations meanwhile: {allocated_while_held})")
        assert not problems, "\n".join(problems)
    finally:
        if hold is not None:
            hold.go.set()
        mgr.close()


# =========================================================================== slot sync vs. LMDB commit
class _RecordingTxn:
    """A write transaction that records, on commit, the slots of the index records it published."""

    def __init__(self, txn: Any, blocks: Any, events: list[tuple[Any, ...]]) -> None:
        self._txn = txn
        self._blocks = blocks
        self._events = events
        self._published: list[tuple[int, Any]] = []   # (slot, token) of each slot entry put in ``blocks``

    def _note(self, value: Any, db: Any) -> None:
        if db is self._blocks:
            h = parse_header(bytes(value))
            if h.in_slot:
                self._published.append((h.slot, h.token))

    def replace(self, key: Any, value: Any, db: Any = None) -> Any:
        self._note(value, db)
        return self._txn.replace(key, value, db=db)

    def put(self, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
        self._note(value, kw.get("db"))
        return self._txn.put(key, value, *args, **kw)

    def commit(self) -> None:
        self._txn.commit()
        self._events.append(("commit", tuple(self._published)))

    def __enter__(self) -> "_RecordingTxn":
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        r = self._txn.__exit__(*exc)    # commits unless an exception leaves the block
        if exc[0] is None:
            self._events.append(("commit", tuple(self._published)))
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class _RecordingEnv:
    """The disk store's LMDB environment (``DiskEnv.env`` is read on each use), its write transactions recorded."""

    def __init__(self, env: Any, blocks: Any, events: list[tuple[Any, ...]]) -> None:
        self._env = env
        self._blocks = blocks
        self._events = events

    def begin(self, *args: Any, **kw: Any) -> Any:
        txn = self._env.begin(*args, **kw)
        return _RecordingTxn(txn, self._blocks, self._events) if kw.get("write") else txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def _record_disk_calls(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record, in the order they happen: ``("write", slot)`` for each ``pwritev`` into the slot file,
    ``("sync",)`` for each ``fdatasync``/``fsync`` of it, ``("commit", ((slot, token), ...))`` for each
    committed write transaction (with the slot entries it published), ``("report", token, ok)`` for
    each spill report the writer sends."""
    events: list[tuple[Any, ...]] = []
    fd, sb = store.slots.fd, store.slots.slot_bytes
    real_pwritev, real_fdatasync, real_fsync = os.pwritev, os.fdatasync, os.fsync

    def pwritev(f: int, buffers: Any, offset: int, *rest: Any) -> int:
        if f == fd:
            events.append(("write", offset // sb))
        return real_pwritev(f, buffers, offset, *rest)

    def fdatasync(f: int) -> None:
        real_fdatasync(f)
        if f == fd:
            events.append(("sync",))

    def fsync(f: int) -> None:
        real_fsync(f)
        if f == fd:
            events.append(("sync",))

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    store.db.env = _RecordingEnv(store.db.env, store.db.blocks, events)
    out = store.writer._out
    real_put = out.put

    def put(item: Any) -> None:
        if getattr(item, "kind", None) is JobKind.SPILL:
            events.append(("report", item.token, item.ok))
        real_put(item)

    out.put = put
    return events


def _commits_ahead_of_their_sync(events: list[tuple[Any, ...]]) -> list[str]:
    """Each published slot entry whose slot's last write before the commit has no sync of the slot file
    between that write and the commit."""
    bad = []
    last_write: dict[int, int] = {}
    last_sync = -1
    for i, ev in enumerate(events):
        if ev[0] == "write":
            last_write[ev[1]] = i
        elif ev[0] == "sync":
            last_sync = i
        elif ev[0] == "commit":
            for slot, _ in ev[1]:
                w = last_write.get(slot)
                if w is None:
                    bad.append(f"commit #{i} published slot {slot}, which was never written")
                elif last_sync < w:
                    bad.append(f"commit #{i} published slot {slot} written at #{w}, last slot-file sync at "
                               f"#{last_sync}: its bytes were not durable before the commit")
    return bad


# the LMDB flags each level sets (docs/architecture.md, "Durability"): sync, metasync
_LMDB_FLAGS = {"sync": (True, True), "batch": (True, False), "none": (False, False)}


@pytest.mark.disk_threads
@pytest.mark.parametrize("durability", ["sync", "batch", "none"])
def test_slot_bytes_are_synced_before_the_commit_that_publishes_them(tmp_path, monkeypatch, durability):
    """Guards the order in ``Writer._commit``: ``slots.sync()`` (``fdatasync`` of the slot file) before
    the LMDB transaction that publishes the batch's index records.

    "sync" and "batch" promise that a committed index record never points at bytes a power loss can
    take: every commit that publishes a slot entry must come after a sync of the slot file that
    follows the last write of that slot.  "none" promises only to survive a process crash: it never
    syncs the slot file.  At every level a spill is reported ok only after the commit that published
    it.  The workload has batches of one and of two spills (a writer gate holds the first commit while
    more spills queue), and enough blocks to evict entries and reuse their slots."""
    kv = make_kv(64)
    cfg = make_config(host_slots=16, disk_path=tmp_path / "d", disk_capacity_bytes=32 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0, durability=durability)
    mgr, mover = make_fake_manager(cfg, kv)
    store = mgr.disk
    gate = WriterGate(block_from=1, max_hold=BOUND_S)
    try:
        events = _record_disk_calls(store, monkeypatch)
        store.fault_hook = gate
        keys = [f"k{i:03d}".encode() for i in range(40)]
        stored(mgr, mover, kv, keys[:1], [0])       # its batch is held at the start of its commit
        gate.entered(1, timeout=BOUND_S)
        stored(mgr, mover, kv, keys[1:5], [1, 2, 3, 4])   # these queue behind it: batches of two
        gate.open()
        assert mgr.flush(timeout=BOUND_S)
        for i, k in enumerate(keys[5:]):             # past the 28-block index: evictions, slots reused
            stored(mgr, mover, kv, [k], [5 + i % 8])
            assert mgr.flush(timeout=BOUND_S)
        recorded = list(events)
        flags = store.db.env.flags()
    finally:
        gate.open()
        mgr.close()

    commits = [ev for ev in recorded if ev[0] == "commit" and ev[1]]
    published = [tok for ev in commits for _, tok in ev[1]]
    assert len(published) == len(keys) and len(set(published)) == len(keys), \
        f"expected {len(keys)} published spills, the commits published {len(published)}"
    assert any(len(ev[1]) >= 2 for ev in commits), "no batch of several spills was exercised"
    assert len({s for ev in commits for s, _ in ev[1]}) < len(published), "no slot was reused"

    # every level: a spill is reported ok only after the commit that published it
    committed_at = {tok: i for i, ev in enumerate(recorded) if ev[0] == "commit" for _, tok in ev[1]}
    early = [(i, ev[1]) for i, ev in enumerate(recorded)
             if ev[0] == "report" and ev[2] and not committed_at.get(ev[1], len(recorded)) < i]
    assert not early, f"spills reported ok before (or without) the commit publishing them: {early}"
    assert (flags["sync"], flags["metasync"]) == _LMDB_FLAGS[durability], \
        f"LMDB flags for durability={durability!r}: {flags}"

    syncs = [i for i, ev in enumerate(recorded) if ev[0] == "sync"]
    if durability == "none":
        # promises a process crash only (the page cache survives it): the slot file is never synced
        assert syncs == [], f"durability='none' synced the slot file {len(syncs)} times"
        return
    bad = _commits_ahead_of_their_sync(recorded)
    assert not bad, f"durability={durability!r}, {len(bad)} published entries not synced first:\n" + "\n".join(bad[:5])
