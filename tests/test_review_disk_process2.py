"""Second adversarial review of the disk I/O process and its protocol (tiered_kv/disk/proc.py, child.py,
pipes.py, tiered_kv/pages.py, tiered_kv/hostmem.py, and DiskTier's restart of the child).

What it proved wrong, each pinned by a test that failed before its fix:

* P1  proc.py imported no ``subprocess``: ``ProcessDiskStore._gone``'s ``except subprocess.TimeoutExpired`` (a
      receiver that ends while the child lives) raised NameError; the child's ops were never answered, the store
      never went down, the child was never killed.  Now a receiver that cannot apply a frame kills the child at
      once, and its ops are answered as failed.
* P2  ``ProcessDiskStore._first_frame`` read the child's first frame with no deadline: a child that stops
      answering at open hung the constructor (and ``DiskTier.restart``, run inside ``poll()``) for ever.
* P3  ``pipes._spawn`` kept its spawner queue across ``fork()``: in a forked process the thread that starts the
      child does not exist, and opening a disk tier there blocked for ever.  The same test found that torch's
      inter-op threads do not survive ``fork()`` either: a forked process's native CPU mover waited for ever at
      its warm-up (it now copies on Python threads there).
* P4  ``TierCore.close_disk`` reconciled a dead child's disk only if the store was already ``down``: when
      close() began after the child died but before the receiver queued its answers, no child was started, and
      a key invalidated meanwhile was served again after the next open.
* P5  ``child_main`` ignored SIGINT only: a SIGTERM/SIGHUP sent to the engine's process group (systemd's stop, a
      closed terminal) killed the disk I/O process under the engine's graceful shutdown: queued spills lost,
      ``flush()`` False, ``io_process_died`` counted.
* P6  ``ProcessDiskStore.close()`` joined the receiver with no timeout after killing a child that did not finish:
      a child that SIGKILL does not end at once (uninterruptible sleep on a hung disk) hung close().
* P7  ``pages.populate_read`` with a ``chunk`` that is not a page multiple stopped after one chunk and reported
      EINVAL (the "kernel too old" answer) instead of populating the range.

Plain tests at the end pin guarantees checked and found to hold: ``populate_read`` stops between chunks and
reports refusals by errno, ``_Frames`` reassembles frames split at any byte, the child's ``_Outbox`` sends each
answer once and each producer's in order under concurrent writers/readers/log records, and a raw
``ProcessDiskStore`` answers a spill group once and leaves no child, pipe or thread after close().

Every interleaving is forced (SIGSTOP/SIGKILL of the child via ``kill_for_test`` or right after its spawn,
the receiver held in ``_answer_failed``, a failing dispatch); the only waits are bounded joins that detect a
hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from tiered_kv.disk import proc
from tiered_kv.disk.proc import ProcessDiskStore, ProcessStartError, SharedHost
from tiered_kv.disk.records import DiskOptions, FlushDone
from tiered_kv.hostmem import make_shared_rows
from tiered_kv.reports import CompletionQueue, Report

from disk_helpers import (NS, PYTHON, REPO, ROW, Rig, drain, fill, keys, load_ok, make_kv, metric,  # noqa: F401
                          raw_keys, rig, store_one, store_seq)

from test_disk_process import _child, _spill_to_a_stopped_child, _wait_down, hold_answers  # the same helpers

pytestmark = pytest.mark.timeout(120)


def reap(store: ProcessDiskStore) -> None:
    """A test's end: the store's child killed (if it still runs) and waited for."""
    try:
        os.kill(store.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        store._proc.wait(30)
    except Exception:   # noqa: BLE001 - gone already, or not ours to wait for
        pass


class RawSlab:
    """A memfd host slab and the options of a raw :class:`ProcessDiskStore` over it (no manager)."""

    def __init__(self, tmp_path: Path, slots: int = 8) -> None:
        import ctypes

        self.mm, self.fd = make_shared_rows(slots, ROW)
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(anchor)
        del anchor
        self.q = CompletionQueue()
        self.opts = DiskOptions(path=tmp_path / "d", namespace=NS, block_bytes=ROW, capacity_bytes=64 * ROW,
                                batch_seconds=0.0)
        self.host = SharedHost(self.fd, 0, slots, ROW, self.base, populate=False)

    def open(self) -> ProcessDiskStore:
        return ProcessDiskStore(self.opts, self.q, self.host)

    def view(self, slot: int) -> memoryview:
        return memoryview(self.mm)[slot * ROW:(slot + 1) * ROW]

    def close(self) -> None:
        os.close(self.fd)


# --------------------------------------------------------------------------- P1
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_receiver_that_ends_while_the_child_lives_still_answers_and_kills_it(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver ends on any exception out of a frame (a host callback or logging filter that raises, an
    unpicklable frame, MemoryError), not only at EOF; ``_gone`` then waits ``_CLOSE_TIMEOUT_S`` for a child
    that is alive and well, and its ``except subprocess.TimeoutExpired`` clause is a NameError."""
    monkeypatch.setattr(proc, "_CLOSE_TIMEOUT_S", 1.0)
    slab = RawSlab(tmp_path)
    store = slab.open()
    pid = store.pid
    try:
        store.kill_for_test(signal.SIGSTOP)          # the spill below stays outstanding
        token = uuid.uuid4()
        assert store.submit_spill(token, b"k", slab.view(0))
        store.kick()
        real = store._dispatch

        def failing(items):  # type: ignore[no-untyped-def]
            raise RuntimeError("a host callback failed")

        store._dispatch = failing                    # the next frame the receiver reads raises
        store.kill_for_test(signal.SIGCONT)          # the child goes on and sends its status: the receiver ends
        deadline = time.monotonic() + 20
        while not store.down and time.monotonic() < deadline:
            time.sleep(0.01)
        store._dispatch = real
        got = []
        while (r := slab.q.get(0)) is not None:
            got.append(r)
        assert store.down, "the receiver ended but the store never went down (its ops unanswered)"
        assert [(type(r).__name__, r.token, r.ok) for r in got] == [("Report", token, False)]
    finally:
        reap(store)
        store.close()
        slab.close()


# --------------------------------------------------------------------------- P2
def test_an_open_whose_child_never_answers_is_bounded_by_the_open_timeout(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc, "_OPEN_TIMEOUT_S", 1.0)
    real_spawn = proc._spawn
    spawned: list[subprocess.Popen] = []

    def stopped_spawn(argv, fds):  # type: ignore[no-untyped-def]
        p = real_spawn(argv, fds)
        os.kill(p.pid, signal.SIGSTOP)               # the child hangs before it answers its open
        spawned.append(p)
        return p

    monkeypatch.setattr(proc, "_spawn", stopped_spawn)
    slab = RawSlab(tmp_path)
    outcome: list[object] = []

    def opening() -> None:
        try:
            outcome.append(slab.open())
        except BaseException as exc:   # noqa: BLE001 - what the constructor raised is the outcome
            outcome.append(exc)

    t = threading.Thread(target=opening, daemon=True)
    t.start()
    t.join(15)                                       # 15x the (patched) open timeout
    hung = t.is_alive()
    for p in spawned:                                # let a hung constructor go: its read sees EOF
        try:
            p.kill()
        except ProcessLookupError:
            pass
    t.join(60)
    for o in outcome:
        if isinstance(o, ProcessDiskStore):
            o.close()
    slab.close()
    assert not hung, "the constructor still waits for a child that never answered, past _OPEN_TIMEOUT_S"
    assert outcome and isinstance(outcome[0], ProcessStartError), outcome


# --------------------------------------------------------------------------- P3
_FORK_SCRIPT = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {tests!r})
    from prometheus_client import CollectorRegistry
    import torch
    from disk_helpers import disk_config, make_kv
    from tiered_kv import TierManager

    def open_close(path):
        kv = make_kv(rows=4)
        mgr = TierManager(disk_config(path, disk_io="process"), kv, registry=CollectorRegistry())
        assert type(mgr.disk).__name__ == "ProcessDiskStore", type(mgr.disk)
        mgr.close()

    open_close({first!r})                            # the spawner thread starts in this process
    pid = os.fork()
    if pid == 0:                                     # a forked worker opens its own tier
        t = threading.Thread(target=open_close, args=({second!r},), daemon=True)
        t.start()
        t.join(20)
        os._exit(3 if t.is_alive() else 0)
    _, status = os.waitpid(pid, 0)
    print("forked:", os.waitstatus_to_exitcode(status))
""")


def test_a_forked_process_can_open_a_disk_tier_after_its_parent_did(tmp_path: Path) -> None:
    script = _FORK_SCRIPT.format(tests=str(REPO / "tests"), first=str(tmp_path / "a"), second=str(tmp_path / "b"))
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=90, cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "forked: 0" in out.stdout, (out.stdout, out.stderr[-3000:])


# --------------------------------------------------------------------------- P4
def test_a_key_invalidated_after_the_child_died_stays_gone_when_close_beats_the_receiver(rig: Rig) -> None:
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    ks = keys(3, "race")
    store_seq(mgr, kv, ks)
    store = _child(mgr)
    held, go = hold_answers(store)                   # the receiver saw the death, its answers not queued yet
    store.kill_for_test(signal.SIGKILL)
    try:
        assert held.wait(30)
        assert store.dead and not store.down
        mgr.invalidate(ks[1])                        # its tomb goes to the dead child's pipe
        real_kick = store.kick

        def kick_then_let_go() -> None:              # close() reached the store's own close: let the receiver go
            go.set()
            real_kick()

        store.kick = kick_then_let_go  # type: ignore[method-assign]
        path = mgr.config.disk_dir
        rig.close(mgr)
    finally:
        go.set()
    mgr2 = rig.open(make_kv(rows=8), host_slots=8, disk_slots=64)
    assert mgr2.lookup([ks[0]]) == 1                 # the others survived
    assert mgr2.lookup([ks[1]]) == 0, "an invalidated key is back after the reopen"
    del path


# --------------------------------------------------------------------------- P5
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_group_wide_termination_signal_leaves_the_engines_shutdown_to_the_engine(rig: Rig, sig: int) -> None:
    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    store = _spill_to_a_stopped_child(mgr, kv, b"term")   # a spill sent, not yet written
    assert store.queue_depth == 1
    store.kill_for_test(sig)                         # what a signal to the process group gives the child
    store.kill_for_test(signal.SIGCONT)
    assert mgr.flush(timeout=30) is True, "the spill queued in the disk I/O process was lost"
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_process_died") == 0
    assert _child(mgr) is store


# --------------------------------------------------------------------------- P6
def test_close_returns_when_the_killed_child_does_not_exit_at_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proc, "_CLOSE_TIMEOUT_S", 1.0)
    slab = RawSlab(tmp_path)
    store = slab.open()
    pid = store.pid
    store.kill_for_test(signal.SIGSTOP)              # the child no longer finishes anything
    store._proc.kill = lambda: None  # type: ignore[method-assign]  # SIGKILL pending, not acted on yet (D state)
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(15)                                  # 15x the (patched) close timeout
    hung = closer.is_alive()
    os.kill(pid, signal.SIGKILL)                     # the disk comes back: the kill takes effect
    closer.join(60)
    slab.close()
    assert not hung, "close() still waits for a child that its kill did not end"


# --------------------------------------------------------------------------- P7
def test_populate_read_with_a_chunk_that_is_not_a_page_multiple_populates_the_whole_range() -> None:
    import ctypes
    import mmap

    from tiered_kv.pages import PAGE, populate_read

    mm = mmap.mmap(-1, 16 * PAGE)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    try:
        done, _, why = populate_read(addr, 16 * PAGE, chunk=PAGE + 1)
    finally:
        del anchor
        mm.close()
    assert (done, why) == (16 * PAGE, None)


# =========================================================================== guarantees that hold
class _FakeLib:
    """A libc whose madvise records its calls, refusing from call ``refuse_at`` on with ``errno``."""

    def __init__(self, refuse_at: int = 0, err: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.refuse_at, self.err = refuse_at, err

    def madvise(self, addr: int, length: int, advice: int) -> int:
        import ctypes

        self.calls.append((addr, length, advice))
        if self.refuse_at and len(self.calls) >= self.refuse_at:
            ctypes.set_errno(self.err)
            return -1
        return 0


def test_populate_read_stops_between_chunks_and_reports_a_refusal_by_its_errno_without_raising() -> None:
    import errno

    from tiered_kv.pages import MADV_POPULATE_READ, PAGE, populate_read

    chunk, base = 4 * PAGE, 1 << 30
    lib = _FakeLib()
    asked = iter([False, False, True])
    done, _, why = populate_read(base, 10 * chunk, lambda: next(asked), lib=lib, chunk=chunk)
    assert (done, why) == (2 * chunk, "stopped") and len(lib.calls) == 2
    assert [c[0] for c in lib.calls] == [base, base + chunk] and {c[2] for c in lib.calls} == {MADV_POPULATE_READ}
    lib = _FakeLib(refuse_at=3, err=errno.ENOMEM)
    done, _, why = populate_read(base, 10 * chunk, lib=lib, chunk=chunk)
    assert (done, why) == (2 * chunk, "ENOMEM")
    lib = _FakeLib()
    done, _, why = populate_read(base, 3 * chunk - 5, lib=lib, chunk=chunk)   # the last piece is short
    assert why is None and [c[1] for c in lib.calls] == [chunk, chunk, chunk - 5]


def test_frames_split_at_any_byte_are_read_back_whole_and_in_order() -> None:
    import random

    from tiered_kv.disk.pipes import _frame, _Frames

    rng = random.Random(20240607)
    objs = [("r", i, b"x" * rng.randrange(0, 300_000), {"k": i}) for i in range(40)]
    data = b"".join(_frame(o) for o in objs)
    r, w = os.pipe()

    def writer() -> None:
        pos = 0
        while pos < len(data):
            n = rng.choice([1, 2, 3, 7, 4096, 65_537, 400_000])
            os.write(w, data[pos:pos + n])           # blocking: a short frame piece at a time
            pos += n
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    frames = _Frames(r)
    try:
        got = [frames.next() for _ in objs]
        with pytest.raises(EOFError):
            frames.next()
    finally:
        t.join()
        os.close(r)
    assert got == objs


def test_the_outbox_sends_every_answer_once_and_each_producers_in_order() -> None:
    """Writers' answers (the sender's to send), readers' runs (sent inline, or left to the sender when a
    frame is being written) and log records from several threads at once: each item leaves exactly once,
    and the items of one producer leave in the order it put them."""
    import pickle

    from tiered_kv.disk import child
    from tiered_kv.jobs import JobKind

    sent: list[tuple] = []
    box = child._Outbox(lambda data: sent.extend(pickle.loads(data[4:])))
    box.status = lambda: {"tombstones": 0}
    box.inline = True
    stop = threading.Event()
    producers = 6
    start = threading.Barrier(producers + 1)

    def sender() -> None:
        start.wait()
        while not stop.is_set():
            box.wait(0.01)
            if box.pending():
                box.send(block=True)
        box.send(block=True)

    def producer(p: int) -> None:
        start.wait()
        for i in range(300):
            tok = uuid.UUID(int=(p << 32) | i)
            if p % 3 == 0:                           # a writer: spill reports and flush answers
                box.put(Report(tok, JobKind.SPILL, True) if i % 2 else FlushDone(tok, True))
            elif p % 3 == 1:                         # a reader: a run of promote answers at once
                box.put_many([Report(tok, JobKind.PROMOTE, True)])
            else:                                    # a log record
                box.put(("l", "tiered_kv.test", 10, f"{p}:{i}"))

    threads = [threading.Thread(target=sender)] + [threading.Thread(target=producer, args=(p,))
                                                   for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    seen: dict[int, list[int]] = {p: [] for p in range(producers)}
    for it in sent:
        if it[0] in ("r", "f"):
            seen[it[1] >> 32].append(it[1] & 0xFFFFFFFF)
        elif it[0] == "l":
            p, i = it[3].split(":")
            seen[int(p)].append(int(i))
    assert all(seen[p] == list(range(300)) for p in range(producers)), {p: len(v) for p, v in seen.items()}


def _pipe_fds() -> set[str]:
    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            out.add(f"{f}->{link}")
    return out


def test_a_spill_group_is_answered_once_and_close_leaves_no_child_pipe_or_thread(tmp_path: Path) -> None:
    slab = RawSlab(tmp_path)
    before_fds, before_threads = _pipe_fds(), {t.name for t in threading.enumerate()}
    store = slab.open()
    pid = store.pid
    try:
        for s in range(3):
            slab.view(s)[:] = bytes([s + 1]) * ROW
        toks = [uuid.uuid4() for _ in range(3)]
        assert store.submit_spills(toks, [b"g0", b"g1", b"g2"], [0, 1, 2], None)
        assert store.queue_depth == 3
        flush = uuid.uuid4()
        store.submit_flush(flush)
        got = [slab.q.get(30), slab.q.get(30)]
        assert [(type(r).__name__, r.token, r.ok) for r in got] == [("Report", toks[0], True),
                                                                    ("FlushDone", flush, True)]
        assert slab.q.get(0) is None and store.queue_depth == 0
    finally:
        store.close()
        store.close()                                # idempotent
    assert store.down and store.exit_code == 0 and slab.q.get(0) is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                              # reaped, not a zombie
    assert _pipe_fds() == before_fds
    assert {t.name for t in threading.enumerate()} <= before_threads | {"tiered-kv-disk-spawner"}
    slab.close()
