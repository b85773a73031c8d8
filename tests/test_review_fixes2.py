"""Adversarial review of today's fixes (8cc4c1c reclaim, ee2cecb kept reports, 7387572 inner-pass kick,
deb3ce4 reader loss, 018e12c bounded thread-mode close).

What it proved wrong (each proof failed with an AssertionError before its fix; a broken rig raises
RuntimeError instead):

* ee2cecb: ``reports.get_within`` kept a report a timed get took only when the signal that interrupted it
  was delivered at the mask restore.  A process-directed signal (Ctrl-C) arriving while the owner blocks
  in ``SimpleQueue.get`` is delivered to another thread (the owner's mask holds it off there only), and
  CPython runs the Python handler on the main thread at the first eval-breaker check -- the end of the
  ``q.get(...)`` call, before a Python frame stored the report: it was dropped, its job never reported.
  Forced here by a helper thread that waits until the owner is inside that call, trips SIGUSR1 on itself
  and puts the report.  Fixed: the item goes into ``kept`` in C (``reports._keep``).
* 018e12c: a reader that ``DiskStore.close()`` left running (hung past ``CLOSE_JOIN_S``) and that then
  found its entry corrupt queued the entry's removal with a writer that had ended: it landed in the ended
  writer's queue, never applied: the corrupt entry was back after a reopen.  Fixed: a drained writer stops
  accepting as it ends (a removal then goes to ``_orphans``), and the reaper always settles them.
* 8cc4c1c: when ``env.info()`` failed after a commit, ``_commit`` skipped ``slots.dropped()`` ("the slots it
  dropped stay taken until the next open's recovery"), but a commit that also dropped a headerless record
  then ran ``_reclaim``, which freed the slot that not-yet-durable commit dropped (``durability="batch"``)
  at once, against invariant 12.  Fixed: no reclaim without ``dropped()``.
* deb3ce4: two readers dying together whose replacements both fail -- NOT a defect: each dying reader takes
  itself out of ``_threads`` under ``_lock`` in ``_orphaned``, so the later of the two sees none left and
  answers the queued reads.  The plain test pins it (the barrier holds the first dying reader alive while
  the second decides).

Deterministic: interleavings forced with events, a barrier, a writer gate and wrapped methods; the only
waits are bounded ones that detect a hang.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import lmdb
import pytest

import tiered_kv.disk.store as store_mod
import tiered_kv.reports as reports
from disk_helpers import ROW, StoreRig, WriterGate, content
from tiered_kv.disk import FlushDone
from tiered_kv.disk.readers import Readers
from tiered_kv.disk.records import CORRUPT, NOT_READ, READ_FAILED
from tiered_kv.disk.writer import Writer
from tiered_kv.reports import CompletionQueue


class RigBroken(RuntimeError):
    """The test's own setup did not reach the state it forces: never mistaken for the proved failure."""


def _need(cond: Any, what: str) -> None:
    if not cond:
        raise RigBroken(what)


# ============================================================================ a DiskStore driven directly
class _Store(StoreRig):
    """:class:`disk_helpers.StoreRig`, whose failures outside a proof raise :class:`RigBroken`."""

    def __init__(self, path: Path, slots: int = 8, durability: str = "sync", num_readers: int = 1,
                 read_batch_bytes: Optional[int] = None) -> None:
        kw: dict[str, Any] = {}
        if read_batch_bytes is not None:
            kw["read_batch_bytes"] = read_batch_bytes
        super().__init__(path, slots, durability, num_readers=num_readers, **kw)

    def answer(self, token: uuid.UUID, timeout: float = 30.0) -> Any:
        return self.wait_for(token, timeout)   # None on timeout: the proofs say what was not answered

    def submit(self, key: bytes) -> uuid.UUID:
        buf = bytearray(content(key, ROW).numpy().tobytes())
        self.bufs.append(buf)
        t = uuid.uuid4()
        _need(self.s.submit_spill(t, key, memoryview(buf)), "spill refused")
        return t

    def write(self, key: bytes) -> uuid.UUID:
        t = self.submit(key)
        r = self.answer(t)
        _need(r is not None and r.ok, f"write of {key!r}: {r}")
        return t

    def flush(self) -> bool:
        tok = uuid.uuid4()
        self.s.submit_flush(tok)
        r = self.answer(tok)
        _need(isinstance(r, FlushDone) and r.ok, f"flush: {r}")
        return True

    def damage_payload(self, key: bytes) -> None:
        """Flip the first bytes of ``key``'s slot: the record parses, its checksum fails."""
        slots = self.s.slots
        assert slots is not None
        off = self.slot_of(key) * slots.slot_bytes
        b = bytearray(os.pread(slots.fd, 16, off))
        os.pwrite(slots.fd, bytes(x ^ 0xFF for x in b), off)

    def promote(self, key: bytes, expect: uuid.UUID) -> uuid.UUID:
        p = uuid.uuid4()
        dst = bytearray(ROW)
        self.bufs.append(dst)
        self.s.queue_promote(p, key, expect, memoryview(dst))
        self.s.start_reads()
        return p


# ============================================================================ ee2cecb: the kept report
class _Boom(Exception):
    """What a signal handler raises (Ctrl-C's KeyboardInterrupt, without stopping pytest)."""


def _slice_line() -> int:
    """The line of ``get_within``'s slice that takes an item (the timed ``q.get``, into ``kept``)."""
    lines, first = inspect.getsourcelines(reports.get_within)
    target = [first + i for i, line in enumerate(lines) if "functools.partial(q.get, True" in line]
    _need(len(target) == 1, f"the slice's timed get not found: {target}")
    return target[0]


def _inside_the_slice(f: Any, line: int) -> bool:
    """``f`` (a thread's innermost frame) is blocked in the slice's timed get: in ``reports._keep``, called
    from that line of ``get_within``."""
    return (f is not None and f.f_code is reports._keep.__code__ and f.f_back is not None
            and f.f_back.f_code is reports.get_within.__code__ and f.f_back.f_lineno == line)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill") or sys.version_info < (3, 11),
                    reason="needs pthread_kill and 3.11 frame positions")
def test_a_report_a_timed_get_took_survives_a_handler_tripped_on_another_thread(monkeypatch) -> None:
    """Invariant: every job is reported exactly once, also when Ctrl-C breaks off a wait.  The owner waits in
    ``CompletionQueue.get(timeout)``; SIGINT sent to the process is delivered to a thread that does not hold
    it off (any worker: the owner's mask covers the owner only) and CPython runs the handler on the main
    thread at its next eval-breaker check -- right after ``q.get`` returns the report.  Here a helper thread
    waits until the owner is inside that call, trips SIGUSR1 on itself and puts a report: the handler's
    exception must leave the report for the consumer's next call."""
    _need(threading.current_thread() is threading.main_thread(), "signal handlers run on the main thread only")
    monkeypatch.setattr(reports, "_SLICE_S", 60.0)   # the whole wait is one slice: the helper finds it inside
    line = _slice_line()
    main = threading.get_ident()
    cq = CompletionQueue()
    item = ("report", uuid.uuid4())
    state = {"inside": False}

    def helper() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if _inside_the_slice(sys._current_frames().get(main), line):   # blocked inside the slice's q.get
                state["inside"] = True
                signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)   # tripped here, handled on main
                break
            time.sleep(0.001)   # polling for a state, bounded: not an ordering sleep
        cq.put(item)

    def handler(signum: int, frame: Any) -> None:
        raise _Boom()

    old = signal.signal(signal.SIGUSR1, handler)
    t = threading.Thread(target=helper, name="review-signal-helper", daemon=True)
    got: Any = None
    interrupted = False
    try:
        t.start()
        try:
            got = cq.get(40)
        except _Boom:
            interrupted = True
        t.join(30)
    finally:
        signal.signal(signal.SIGUSR1, old)
    _need(state["inside"], "the helper never saw the owner inside the slice's get")
    if not interrupted:
        _need(got == item, f"no interrupt and no report: {got!r}")
        return   # the handler ran elsewhere: nothing to check
    again = cq.get(0)
    assert again == item, f"the report taken in the interrupted slice was dropped (kept={list(cq._kept)!r})"


# ============================================================================ 018e12c: a reader close() left running
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_removal_queued_by_a_reader_close_left_running_is_applied(tmp_path: Path, monkeypatch) -> None:
    """readers.py: "a read that finds its entry corrupt ... also queues the entry's removal with the writer";
    writer.py ``push``: "a removal must not be lost: close() applies it".  A reader hangs in its read past the
    close bound (``CLOSE_JOIN_S`` shortened to a bound the hang exceeds); close() returns, leaving it to the
    reaper.  The reader then finds the entry's payload corrupt and queues its removal.  Once the reaper
    released the path, a reopen must not find the corrupt entry in the index."""
    monkeypatch.setattr(store_mod, "CLOSE_JOIN_S", 0.2)
    r = _Store(tmp_path / "d")
    t = r.write(b"k")
    r.flush()
    r.damage_payload(b"k")
    entered, release = threading.Event(), threading.Event()
    real_read = Readers._read

    def hung_read(self: Readers, op: Any) -> Any:   # the read blocks "in the kernel" until released
        entered.set()
        release.wait(60)
        return real_read(self, op)

    monkeypatch.setattr(Readers, "_read", hung_read)
    try:
        p = r.promote(b"k", t)
        _need(entered.wait(30), "the reader never started the read")
        r.s.close()                               # bounded: returns with the reader still hung
        _need(r.s._lock_fd >= 0, "close() released the path under a running reader")
        r.s.writer._thread.join(30)              # the writer ended (either close branch): now the reader goes on
        _need(not r.s.writer._thread.is_alive(), "the writer did not end")
    finally:
        release.set()
    rep = r.answer(p)
    _need(rep is not None and not rep.ok and rep.error.startswith(CORRUPT), f"the late read: {rep}")
    reapers = [x for x in threading.enumerate() if x.name == "tiered-kv-disk-reaper"]
    for x in reapers:
        x.join(30)
    _need(r.s._lock_fd < 0, "the reaper never released the path")
    monkeypatch.setattr(Readers, "_read", real_read)
    r2 = _Store(tmp_path / "d")
    try:
        assert all(e.key != b"k" for e in r2.s.entries), \
            "the removal of a corrupt entry the late reader queued was never applied: it is indexed again"
    finally:
        r2.s.close()


# ============================================================================ 8cc4c1c: reclaim after a failed env.info()
class _InfoFails:
    """The LMDB environment, whose ``info()`` raises once when the writer's ``_commit`` asks for it after the
    commit of a chosen batch (the gate's ``arm_at``-th write transaction)."""

    def __init__(self, env: Any, gate: WriterGate, arm_at: int) -> None:
        self._env, self._gate, self._arm_at = env, gate, arm_at
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def info(self) -> Any:
        if (not self.fired and self._gate.calls >= self._arm_at
                and sys._getframe(1).f_code.co_name == "_commit"):
            self.fired = True
            raise lmdb.Error("mdb_env_info: injected")
        return self._env.info()


def test_reclaim_after_a_failed_info_does_not_free_a_slot_whose_drop_is_not_durable(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """Invariant 12 (slots.py): a dropped entry's slot is handed to a new write only once the commit that
    dropped it is durable.  ``_commit``'s own fault path keeps them taken ("until the next open's
    recovery") when ``env.info()`` fails after the commit; the reclaim scan that follows in the same call
    (the batch also removed a headerless record) frees them at once."""
    r = _Store(tmp_path / "d", slots=6, durability="batch")
    gate = WriterGate(block_from=1)
    try:
        r.write(b"a")
        tx = r.write(b"x")
        r.flush()
        old = r.slot_of(b"a")
        r.break_header(b"x")
        db = r.s.db
        assert db is not None
        proxy = _InfoFails(db.env, gate, arm_at=2)
        db.env = proxy
        seen: dict[str, Any] = {}
        real_commit = Writer._commit

        def commit(self: Writer, batch: list[Any]) -> Any:
            out = real_commit(self, batch)
            if proxy.fired and "free" not in seen:   # writer thread, before any later sync could free it
                with self._slots.lock:
                    seen["free"] = old in self._slots.free
            return out

        monkeypatch.setattr(Writer, "_commit", commit)
        r.s.fault_hook = gate
        ty = r.submit(b"y")                        # batch 1: held at its commit
        gate.entered(1)
        p = r.promote(b"x", tx)                    # corrupt: the reader queues the headerless record's removal
        rep = r.answer(p)
        _need(rep is not None and rep.error.startswith(CORRUPT), f"the read of x: {rep}")
        ta = r.submit(b"a")                        # a's rewrite, one batch with the removal: drops `old`
        gate.open()
        _need(r.answer(ty) is not None and r.answer(ta) is not None, "batches unanswered")
        _need(proxy.fired and "free" in seen, f"env.info() never failed after batch 2 ({gate.calls} commits)")
        assert not seen["free"], "the slot a not-yet-durable commit dropped was freed by the reclaim scan"
    finally:
        gate.open()
        if r.s.db is not None and isinstance(r.s.db.env, _InfoFails):
            r.s.db.env = r.s.db.env._env
        r.s.close()


# ============================================================================ deb3ce4: two readers dying together
class _Killed(BaseException):
    """What an asynchronous exception looks like to a reader thread."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_two_readers_dying_together_without_replacements_leave_no_read_unanswered(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """Both readers die on their read and neither replacement starts; the first dying reader is held alive
    (a barrier after its ``_orphaned``) until the second has decided too.  Whichever decides last must see no
    reader left: a read queued afterwards is answered (NOT_READ, or read by a reader started again), never
    left in the queue."""
    r = _Store(tmp_path / "d", num_readers=2, read_batch_bytes=ROW)
    real_read, real_start, real_orphaned = Readers._read, threading.Thread.start, Readers._orphaned
    try:
        ta, tb, tc = r.write(b"a"), r.write(b"b"), r.write(b"c")
        kills = {"left": 2}
        barrier = threading.Barrier(2, timeout=30)
        decided: list[Any] = []

        def read(self: Readers, op: Any) -> Any:
            if kills["left"]:
                kills["left"] -= 1
                raise _Killed("reader killed")
            return real_read(self, op)

        def start(self: threading.Thread) -> None:
            if self.name == "tiered-kv-disk-reader":
                raise RuntimeError("can't start new thread")
            real_start(self)

        def orphaned(self: Readers) -> Any:
            out = real_orphaned(self)
            decided.append(out)
            barrier.wait()           # the first to decide stays alive until the other has decided
            return out

        monkeypatch.setattr(Readers, "_read", read)
        monkeypatch.setattr(threading.Thread, "start", start)
        monkeypatch.setattr(Readers, "_orphaned", orphaned)
        threads = list(r.s.readers._threads)
        _need(len(threads) == 2, "two readers")
        p1 = r.promote(b"a", ta)
        r1 = r.answer(p1)
        _need(r1 is not None and r1.error.startswith(READ_FAILED), f"first death: {r1}")
        p2 = r.promote(b"b", tb)                  # the other reader takes it and dies too
        r2 = r.answer(p2)
        _need(r2 is not None and r2.error.startswith(READ_FAILED), f"second death: {r2}")
        for x in threads:
            x.join(30)
        _need(not any(x.is_alive() for x in threads) and len(decided) == 2, f"deaths: {decided}")
        p3 = r.promote(b"c", tc)
        r3 = r.answer(p3, timeout=30)
        assert r3 is not None, "a read queued after both readers died is never answered"
        assert not r3.ok and r3.error.startswith(NOT_READ), r3
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        monkeypatch.setattr(Readers, "_read", real_read)
        r.s.close()
