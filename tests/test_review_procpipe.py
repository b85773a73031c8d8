"""Adversarial review of the disk I/O process's protocol (tiered_kv/disk/proc.py) and how the tier drives it.

What it proved wrong (each test failed before its fix):

* R1: a host callback (``on_error``, ``on_prevented``, ``on_corrupt``) that raised on the receiver thread ended
  it: the child was killed, and the ops the frame had taken out of ``_outstanding`` were answered by no one;
  any failure while a frame was applied lost them the same way.  Callbacks are guarded now, and a frame that
  fails answers (failed) the ops it took and did not answer.
* R2: ``_gone`` reported the child's death through ``on_error`` before it answered the dead child's ops and
  marked the store down: a callback that raised left them unanswered and the tier never restarted.
* R3: a backlog left when the child died was never dropped: ``backlogged`` (and ``TierCore.unsent()``) stayed
  True while the dead store was the tier's, and every blocking call woke each 0.5 ms for nothing.
* R4: ``kick()`` took the queued ops out before their frame was in the backlog, so an interrupt (Ctrl-C) while
  it was made lost them; in ``close()`` they include the ``X`` op, and the interrupted close then waited its
  whole deadline and killed the child with its writes.  Now the ops stay queued until framed, and an
  interrupted close leaves the child running for the next close() to finish.

Interleavings are forced (a wrapped ``_dispatch``, a callback that raises, a patched ``os.write``, SIGSTOP /
SIGKILL of the child); every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.disk import proc
from tiered_kv.disk.proc import ProcessDiskStore
from tiered_kv.disk.records import FlushDone
from tiered_kv.reports import Report

from disk_helpers import rig  # noqa: F401 (a fixture)
from test_review_disk_process2 import RawSlab, reap

pytestmark = pytest.mark.timeout(60)


def _collect(q: Any) -> list[Any]:
    got = []
    while (r := q.get(0)) is not None:
        got.append(r)
    return got


def _finish(store: ProcessDiskStore, slab: RawSlab) -> None:
    reap(store)
    store._receiver.join(30)
    store.close()
    slab.close()


# --------------------------------------------------------------------------- R1
def _spill_and_flush(store: ProcessDiskStore, slab: RawSlab) -> tuple[uuid.UUID, uuid.UUID]:
    slab.view(0)[:] = b"\x01" * len(slab.view(0))
    spill = uuid.uuid4()
    assert store.submit_spill(spill, b"k0", slab.view(0))
    flush = uuid.uuid4()
    store.submit_flush(flush)
    return spill, flush


def _wait_answers(q: Any, n: int) -> list[Any]:
    got = []
    while len(got) < n:
        r = q.get(30)
        assert r is not None, f"answers so far: {got}"
        got.append(r)
    return got


def test_a_host_callback_that_raises_in_a_frame_stops_neither_its_answers_nor_the_receiver(tmp_path: Path) -> None:
    """proc.py ``_dispatch`` called the host's callbacks (``on_error`` for the child's ``("e", ...)`` items,
    ``on_prevented``, ``on_corrupt``) unguarded on the receiver thread.  One that raised ended the receiver:
    the child was killed as if its reports were unreadable, and the ops the frame had taken out of
    ``_outstanding`` before applying it were answered by no one (a spill in flight for ever: its host slot
    pinned, ``close()`` waiting its whole timeout, ``flush()`` never answered).  Now a callback that raises is
    logged, and the frame's answers and the child's later ones are applied as if it had not."""
    slab = RawSlab(tmp_path)
    calls = []

    def on_error(kind: str, msg: str) -> None:
        calls.append(kind)
        raise RuntimeError("a host callback failed")

    store = ProcessDiskStore(slab.opts, slab.q, slab.host, on_error=on_error)
    real = store._dispatch
    injected = []

    def dispatch(items: list[Any]) -> bool:
        if not injected and any(it[0] in ("r", "f") for it in items):
            injected.append(True)
            items = [("e", "write_failed", "injected before the answers")] + list(items)
        return real(items)

    store._dispatch = dispatch   # type: ignore[method-assign]
    try:
        spill, flush = _spill_and_flush(store, slab)
        got = _wait_answers(slab.q, 2)
        assert sorted((r.token, r.ok) for r in got) == sorted([(spill, True), (flush, True)])
        assert calls == ["write_failed"] and store._receiver.is_alive() and not store.down
        assert store.queue_depth == 0
    finally:
        _finish(store, slab)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_ops_of_a_frame_the_receiver_failed_to_apply_are_still_answered_once(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """proc.py ``_dispatch`` takes every op a frame answers out of ``_outstanding`` before it applies the frame;
    when applying it raised, ``_receive`` killed the child and ``_gone`` answered only what was still
    outstanding: the ops taken out for the failed frame were answered by no one.  Here making the first answer's
    token raises (any failure of the receiver's own code): each op is still answered exactly once (failed),
    and the store goes down."""
    slab = RawSlab(tmp_path)
    store = ProcessDiskStore(slab.opts, slab.q, slab.host)
    real = proc.uuid_from_int
    failed = []

    def uuid_once(v: int) -> uuid.UUID:
        if not failed:
            failed.append(v)
            raise MemoryError("injected: the receiver could not build an answer")
        return real(v)

    monkeypatch.setattr(proc, "uuid_from_int", uuid_once)
    try:
        spill, flush = _spill_and_flush(store, slab)
        store._receiver.join(30)
        assert not store._receiver.is_alive() and failed
        got = _collect(slab.q)
        answered = [r.token for r in got if isinstance(r, (Report, FlushDone))]
        assert sorted(answered) == sorted([spill, flush]), f"answers: {got}"
        assert not any(r.ok for r in got)
        assert store.down and store.queue_depth == 0
    finally:
        _finish(store, slab)


# --------------------------------------------------------------------------- R2
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_childs_ops_are_answered_and_the_store_goes_down_even_if_on_error_raises(tmp_path: Path) -> None:
    """proc.py:321-327: when the child dies, ``_gone`` reports ``io_process_died`` through the host's
    ``on_error`` (proc.py:324) *before* ``_answer_failed(rest)`` and ``self._down = True``, all on the receiver
    thread with no guard.  A callback that raises (a metrics backend error, a host hook with a bug) ends the
    receiver there: the dead child's spills, promotes and flushes are never answered, ``down`` stays False so
    ``DiskTier.restart`` never runs (the tier stays disabled for the process's life), ``queue_depth`` never
    returns to 0, and the tier's ``close()`` waits its whole ``CLOSE_TIMEOUT_S`` for spills that will never be
    answered.  Fix: answer ``rest`` and set ``_down`` in a ``finally`` around the callback (or call the
    callback last, guarded by ``try/except Exception: log.exception``)."""
    slab = RawSlab(tmp_path)

    def on_error(kind: str, msg: str) -> None:
        raise RuntimeError("metrics backend failed")

    store = ProcessDiskStore(slab.opts, slab.q, slab.host, on_error=on_error)
    try:
        store.kill_for_test(signal.SIGSTOP)       # the spill below stays outstanding in the child
        spill = uuid.uuid4()
        assert store.submit_spill(spill, b"k0", slab.view(0))
        store.kick()
        store.kill_for_test(signal.SIGKILL)
        store._receiver.join(30)
        assert not store._receiver.is_alive()
        got = _collect(slab.q)
        assert [(type(r).__name__, r.token, r.ok) for r in got] == [("Report", spill, False)]
        assert store.down and store.queue_depth == 0
    finally:
        _finish(store, slab)


# --------------------------------------------------------------------------- R3
def _stall_with_a_full_pipe(store: ProcessDiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child stops reading (SIGSTOP) and its command pipe refuses every write, as a full one does."""
    store.kill_for_test(signal.SIGSTOP)
    write = os.write

    def full(fd: int, data: Any) -> int:
        if fd == store._cmd_w:
            raise BlockingIOError(11, "pipe full")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)


def test_a_store_whose_child_died_with_a_backlog_is_not_backlogged_after_its_close(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """proc.py:404-410: ``kick()`` with ops queued on a store that is ``_down`` returns *before* it looks at the
    backlog, and ``close()`` (proc.py:486-491, which always queues ``("X",)``) therefore never reaches the write
    that would fail with EPIPE and clear it; ``_release`` then sets ``_cmd_w = -1`` and no later ``kick()``
    writes either (proc.py:410).  A child that died with the pipe full (it had stopped reading: the very case in
    which a backlog exists) whose death the receiver applied before the owner's next pass is closed so by
    ``DiskTier.restart`` (disk_tier.py:265) at that pass: ``backlogged`` stays True for as long as that dead
    store is the tier's (the new child's start -- a full recovery scan, up to ``_OPEN_TIMEOUT_S`` -- and any
    back-off after a failed start, for ever when no restart succeeds).  ``TierCore.unsent()`` is then True
    and every blocking call of the manager wakes each ``POLL_SLICE_S`` (0.5 ms) instead of ``WAKE_S`` (0.5 s):
    a 2000/s busy-wake that holds the GIL against the engine for nothing.  Fix: in ``kick()`` clear the backlog
    when ``_down`` (``if self._down: self._cmds.clear(); self._backlog.clear(); return``), and in ``_release``
    clear it as well."""
    slab = RawSlab(tmp_path)
    store = slab.open()
    try:
        _stall_with_a_full_pipe(store, monkeypatch)
        store.submit_delete(uuid.uuid4(), b"k0")   # (an op that goes at once: a lone touch waits for company)
        store.kick()
        assert store.backlogged                    # the pipe held the frame back
        monkeypatch.undo()
        store.kill_for_test(signal.SIGKILL)        # the child dies with the backlog unsent
        store._receiver.join(30)
        assert store.down and store._backlog       # the dead child's frame is still in the backlog
        store.close()                              # what DiskTier.restart does with the dead store first
        store.kick()
        assert not store.backlogged and not store._backlog, "a closed store whose child is gone holds ops back"
    finally:
        _finish(store, slab)


def test_the_tier_holds_nothing_unsent_after_a_child_died_with_a_full_pipe(rig, monkeypatch: pytest.MonkeyPatch
                                                                          ) -> None:
    """The same defect as above, seen through the manager: the child stops reading, the engine's pass leaves
    its spill in the backlog (pipe full), the child dies, and the next pass (``end_step`` -> ``DiskTier.restart``
    -> ``store.close()``) closes the dead store with the backlog still there.  While the new child's start is
    in flight or backing off (here: it cannot start), ``TierCore.unsent()`` (tiers.py:1038-1041) stays True,
    so ``TierManager``'s blocking waits (manager.py:638) and ``simple_block_until`` (tiers.py:1148) poll every
    0.5 ms instead of 0.5 s, for nothing that can ever be sent."""
    from disk_helpers import fill, make_kv, settle_restart
    from test_disk_process import _child
    from tiered_kv.errors import DiskTierError

    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    tier = mgr._core.disk
    store = _child(mgr)
    real = tier._reopen

    def broken() -> ProcessDiskStore:
        raise DiskTierError("injected: cannot start")

    tier._reopen = broken
    try:
        _stall_with_a_full_pipe(store, monkeypatch)
        fill(kv, 0, b"held-back")
        mgr.wait([mgr.store(b"held-back", 0)], timeout=30)
        mgr.poll()
        assert store.backlogged and mgr._core.unsent()   # the spill waits for room in the pipe
        monkeypatch.undo()
        store.kill_for_test(signal.SIGKILL)
        store._receiver.join(30)
        assert store.down
        mgr.poll()                                        # the restart: the dead store is closed, a start fails
        settle_restart(mgr)
        assert tier.store is store and not tier.usable
        assert not mgr._core.unsent(), "a dead, closed store still counts as holding ops back"
    finally:
        tier._reopen = real


# --------------------------------------------------------------------------- R4
def test_a_close_interrupted_while_it_frames_its_ops_is_finished_cleanly_by_the_next(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    """proc.py:405-408: ``kick()`` takes the queued ops out of ``_cmds`` (``cmds, self._cmds = self._cmds, []``)
    before ``_frame(cmds)`` has made their frame and put it in the backlog.  An exception in between -- the
    engine's Ctrl-C (``KeyboardInterrupt``, delivered between any two bytecodes, here while the frame is being
    pickled) -- drops them: neither queued nor sent.  In ``close()`` (proc.py:486-491) those ops include
    ``("X",)``, appended once only (``_closing`` is already True at the next close): the child never learns
    it should exit, ``close()``'s ``finally`` (proc.py:501-507) waits the whole ``_CLOSE_TIMEOUT_S`` (120 s)
    for a child that is alive and well, then SIGKILLs it (the spills queued in it are lost, ``io_process_died``
    counted) -- and the next close() has nothing left to finish.  The docstring promises "a close an interrupt
    broke off is finished by the next one"; a Ctrl-C at shutdown instead hangs it for two minutes and loses
    data.  Fix: do not lose ops on an exception in ``kick()`` (``try: self._backlog += _frame(cmds) except
    BaseException: self._cmds[:0] = cmds; raise``) and in ``close()`` do not wait/kill in the ``finally``
    when the exception came before ``("X",)`` reached the backlog (leave it to the next close)."""
    monkeypatch.setattr(proc, "_CLOSE_TIMEOUT_S", 3.0)
    slab = RawSlab(tmp_path)
    errors: list[str] = []
    store = ProcessDiskStore(slab.opts, slab.q, slab.host, on_error=lambda kind, msg: errors.append(kind))
    real = proc._frame
    hit = []

    def frame(obj: Any) -> bytes:
        data = real(obj)
        if not hit and isinstance(obj, list) and ("X",) in obj:
            hit.append(True)
            raise KeyboardInterrupt   # Ctrl-C while the close's frame was being made
        return data

    monkeypatch.setattr(proc, "_frame", frame)
    try:
        slab.view(0)[:] = b"\x02" * len(slab.view(0))
        spill = uuid.uuid4()
        assert store.submit_spill(spill, b"k0", slab.view(0))
        with pytest.raises(KeyboardInterrupt):
            store.close()
        store.close()                 # the engine's shutdown goes on: the close is finished
        assert hit
        assert store.exit_code == 0 and "io_process_died" not in errors, \
            f"the child was killed (exit {store.exit_code}, errors {errors}): the interrupted close lost its X op"
        got = _collect(slab.q)
        assert [(type(r).__name__, r.token, r.ok) for r in got] == [("Report", spill, True)]
    finally:
        _finish(store, slab)
