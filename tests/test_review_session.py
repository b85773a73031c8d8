"""Adversarial review of the changes since 4775f5c (the day's fixes): what it proved wrong, each pinned by a
test that failed before its fix:

1. disk/proc.py ProcessDiskStore.close: a close() interrupted in its bounded waits (Ctrl-C, a stop signal's
   unwinding) left _closing set, so the next close() returned at once: the pipes and the path lock were never
   released (before the day's change a second close() finished the job).
2. disk/proc.py ProcessDiskStore.close/_gone: close() read receiver.is_alive() and set _release_late with no
   hand-off with the receiver; a killed child that went in between left the receiver's _gone() past its
   _release_late check, and nobody released the pipes and the path lock (both now look under the store's lock).
3. remote/writer.py Writer._send/_died: the reports a batch held back until their room was released were lost
   when the writer thread died later in the same batch (a published put never answered: flush() and close()
   waited out their timeouts); they are kept on the writer now, and _died puts them and gives their room back.
"""

from __future__ import annotations

import signal
import threading

import pytest

from tiered_kv.disk.proc import ProcessDiskStore

from disk_helpers import Rig, keys, make_kv, rig, store_seq  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def _proc_store(rig: Rig) -> ProcessDiskStore:
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    store_seq(mgr, kv, keys(2, "rv"))
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore), type(store)
    return store


def _cleanup(store: ProcessDiskStore) -> None:
    try:
        store.kill_for_test(signal.SIGKILL)
    except OSError:
        pass
    store._receiver.join(30)
    store._release()


def test_close_after_interrupted_close_releases_the_path(rig: Rig) -> None:
    store = _proc_store(rig)
    th = store._receiver
    real_join = th.join
    calls = [0]

    def join(timeout=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt   # Ctrl-C while close() waits for the child
        return real_join(timeout)

    th.join = join  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            store.close()
        store.close()   # "Idempotent": the second close finishes what the first could not
        released = store._lock_fd < 0 and store._cmd_w < 0
    finally:
        if store._lock_fd >= 0:
            _cleanup(store)
    assert released, "the path lock and pipes are still held after a second close()"


class _ReceiverSeenAliveThenGone:
    """Stands in for the receiver thread in close(): the first join does not wait (the child did not close in
    time), is_alive() says alive, and the second is_alive() is observed True just as the killed child goes
    (the real receiver runs _gone() to its end before close() goes on)."""

    def __init__(self, real: threading.Thread) -> None:
        self.real = real
        self.n = 0

    def join(self, timeout=None):  # type: ignore[no-untyped-def]
        return None

    def is_alive(self) -> bool:
        self.n += 1
        if self.n >= 2:
            self.real.join(60)   # the child (killed by close()) is gone and _gone() ran: close() then reads True
        return True


def test_release_late_race_leaves_the_path_held(rig: Rig) -> None:
    store = _proc_store(rig)
    real = store._receiver
    store._receiver = _ReceiverSeenAliveThenGone(real)  # type: ignore[assignment]
    try:
        store.close()
        real.join(60)
        assert not real.is_alive()
        released = store._lock_fd < 0 and store._cmd_w < 0
    finally:
        store._receiver = real
        if store._lock_fd >= 0:
            _cleanup(store)
    assert released, "the child is gone and close() returned, yet the path lock and pipes are held"


# --------------------------------------------------------------------------- remote writer: reports held back
def test_remote_writer_death_after_a_report_was_held_back_loses_it(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("redis")
    from test_remote_store import Gate, Rig as RemoteRig, blocks

    rr = RemoteRig()
    try:
        h = rr.open(redis_url)
        gate = Gate("write")                          # holds the writer after it took its first batch
        h.store.set_test_hook(gate)
        (kc, ka, kb), (dc, da, db) = blocks(3)
        redis_server.command("SET", h.names.tomb(kb), "1")   # B's put will be refused by its key tomb
        (tc,) = h.put_async([kc], [dc])
        gate.entered(1)                               # C's batch taken; A and B queue behind it, one batch
        (ta,) = h.put_async([ka], [da], kick=False)
        (tb,) = h.put_async([kb], [db], kick=False)

        def refused(reason: str) -> None:             # a callback failing on the writer thread (its death is
            raise RuntimeError("on_refused failed")   # answered and restarted by _died)
        h.store._w._on_refused = refused
        gate.open()
        h.store.kick()
        got: dict = {}
        while tb not in got:
            r = h.report()
            got[r.token] = r
        assert got[tc].ok
        assert not got[tb].ok                         # answered by _died (REMOTE_DOWN)
        while ta not in got:                          # A was PUBLISHED before B's refusal killed the thread
            r = h.q.get(5.0)
            if r is None:
                break
            got[r.token] = r
        assert ta in got, "A's put was published but its report was never put (lost with the writer's list)"
    finally:
        rr.close()
