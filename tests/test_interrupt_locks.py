"""A KeyboardInterrupt on the engine's thread never leaves a disk/remote I/O lock held, nor an op lost or queued twice.

The engine's thread (the caller of ``TierManager.store``/``load``/``poll``/``invalidate``/...) hands work to the disk
writer (``tiered_kv.disk.writer.Writer``: ``submit_spills``, ``push``, ``begin_close``), takes the LMDB map lock
shared at close (``tiered_kv.disk.env.RWLock``), and hands work to the remote store's I/O threads
(``tiered_kv.remote``: ``Writer.submit``/``cancel``/``invalidate``, ``Reader.take_room``/``give_room``/``submit``,
``IOThread.kick``/``wake``/``idle``/``wait_idle``/``begin_close``).  Each of those took the threads' lock with
``with self._cond:``; ``Condition.__enter__`` is Python code, and an interrupt at its return (CPython's eval-breaker
check after the C lock's ``__enter__`` returns inside it) leaves the lock taken with no ``with`` to release it
(bpo-29988): the engine's next call and the I/O thread deadlock.  Round 31's
``test_an_interrupted_invalidate_never_leaves_the_disk_writer_locked`` showed it for ``Writer.push``.

Method: round 29's return hook (``tests/test_review_round29_sweep.py``), restricted to the frames of one method
and of everything it calls -- threading.py's ``Condition`` methods included, which round 29's hooks skip -- raises
``KeyboardInterrupt`` at the k-th call return, for every k until the call completes untouched.  The objects are
built without their I/O thread (``_NoThread``), so the queues are seen as the interrupted call left them, with no
thread racing the checks.  After each interrupted call: the lock is free (``acquire(timeout=1)``), nothing but the
KeyboardInterrupt came out (a ``with`` that releases a lock it does not hold raises RuntimeError), the op is
queued once or not at all and every count that goes with the queue agrees with it, and the caller's retry (made
only when the op was not queued) queues it and returns.  The last tests run the real threads: a wake-up cut off
inside ``Condition.notify`` only delays the op, and the manager-level sweep of ``invalidate`` with a disk tier.

Each sweep fails on the tree before the fix: the lock stays held at the return of ``Condition.__enter__``.  With
only that swapped for the raw lock, the sweeps still find: a touch's key left in ``_touched`` with none queued (that
key never touched again), ``spills_queued``/``puts_pending``/``tombs_queued`` not counting an op queued (the
queue bound drifts), a fetch's room taken with no job queued, and ``wait_idle`` raising ``RuntimeError('release
unlocked lock')`` out of ``Condition.wait`` (its ``with`` released a lock it no longer held -- or one the I/O
thread held).  ``test_a_wake_up_cut_off_in_kick_only_delays_a_put[_is_owned]`` fails before the fix too (the
remote thread's idle wait had no timeout: the put waited for the owner's next call); the disk flush tests and the
``[release]`` case pass on both trees -- they check that a wake-up cut off inside ``notify`` only delays.
"""

from __future__ import annotations

import _weakrefset
import sys
import threading
import time
import types
import uuid
from typing import Any, Callable, Optional

import pytest

import tiered_kv.disk.writer as disk_writer_mod
import tiered_kv.manager
from test_review_round29_sweep import ACTIONS, LIB, WAIT_S, World, _interrupt_kth, _returned, check_disk, prepare_disk
from tiered_kv.disk.env import RWLock
from tiered_kv.disk.records import Delete, DiskOptions, Flush, FlushDone, Spill, Tomb, Touch
from tiered_kv.disk.tombs import Tombs
from tiered_kv.remote.breaker import Breaker
from tiered_kv.remote.iothread import IOThread
from tiered_kv.remote.keys import KeyNames
from tiered_kv.remote.ops import CANCEL, INVALIDATE, PutPart, TombOp
from tiered_kv.remote.reader import Reader
from tiered_kv.remote.records import RemoteOptions
from tiered_kv.remote.writer import Writer as RemoteWriter
from tiered_kv.reports import CompletionQueue

MAX_K = 2000   # a sweep that has not ended by then is a bug of the sweep
_THREADING = threading.__file__
_WEAKREFSET = _weakrefset.__file__


# --------------------------------------------------------------------------------------------- the hook
def _interrupt_inside(fn: Callable[..., Any], k: int) -> tuple[Callable[..., None], list[tuple[int, str, int, str]]]:
    """Raise ``KeyboardInterrupt`` at the ``k``-th call return whose caller runs inside ``fn`` (``fn``'s own frame or
    any frame it called, threading.py's included); ``fired`` gets (k, caller file, caller line, callee).  Only
    callers in the library or threading.py count, and no weak set's callback: a garbage collector's callback
    (hypothesis registers one) or a weakref's runs on top of whatever frame freed or allocated, where an exception
    is only printed ("Exception ignored")."""
    code = fn.__code__

    def counts(frame: Any, caller: Any) -> bool:
        where = caller.f_code.co_filename
        if (not where.startswith(LIB) and where != _THREADING) or frame.f_code.co_filename == _WEAKREFSET:
            return False
        f = caller
        while f is not None and f.f_code is not code:
            f = f.f_back
        return f is not None

    return _interrupt_kth(k, counts)


def _interrupt_in_notify(at: str) -> tuple[Callable[..., None], list[str]]:
    """Raise ``KeyboardInterrupt`` at the first return of ``at`` called from ``Condition.notify``; ``seen`` gets it."""
    seen: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        got = _returned(frame, event, arg)
        if got is None or seen:
            return
        caller, callee = got
        if caller.f_code.co_name == "notify" and callee == at:
            seen.append(callee)
            raise KeyboardInterrupt(f"interrupt at the return of {callee} in Condition.notify")

    return hook, seen


def _call_with(hook: Callable[..., None], call: Callable[[], Any]) -> tuple[Any, Optional[BaseException]]:
    sys.setprofile(hook)
    try:
        return call(), None
    except BaseException as exc:   # noqa: BLE001 - returned: the check says which kinds are allowed
        return None, exc
    finally:
        sys.setprofile(None)


def _lock_free(lock: Any, label: str) -> None:
    got = lock.acquire(timeout=1.0)
    if not got:
        lock.release()   # (let whatever runs after the failing test finish)
    else:
        lock.release()
    assert got, f"{label}: the lock stays held (the next call deadlocks)"


def sweep(fn: Callable[..., Any], setup: Callable[[], Any], call: Callable[[Any], Any],
          check: Callable[[Any, str, Any], None], lock_of: Callable[[Any], Any]) -> int:
    """Interrupt ``call(setup())`` at every call return inside ``fn``; after each: the lock is free, only the
    KeyboardInterrupt came out, and ``check(state, label, result)`` holds (it retries the call if the interrupted
    one left nothing done).  Returns how many call returns were swept."""
    for k in range(1, MAX_K):
        st = setup()
        hook, fired = _interrupt_inside(fn, k)
        result, exc = _call_with(hook, lambda: call(st))
        label = f"{fn.__qualname__} interrupted at {fired[0] if fired else 'no point (ran through)'}"
        _lock_free(lock_of(st), label)
        if fired:
            assert isinstance(exc, KeyboardInterrupt), f"{label}: raised {exc!r}, not the interrupt"
        else:
            assert exc is None, f"{label}: raised {exc!r}"
        check(st, label, result)
        if not fired:
            return k
    raise AssertionError(f"{fn.__qualname__}: more than {MAX_K} call returns")


class _NoThread:
    """Stands for an I/O thread that never runs: the queues stay as the owner's calls leave them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: Optional[float] = None) -> None:
        pass


# --------------------------------------------------------------------------------------------- the disk writer
def _disk_writer(tmp_path: Any, monkeypatch: Any) -> disk_writer_mod.Writer:
    """A disk Writer without its thread (nothing takes its queue), queue_blocks 8."""
    fake = types.SimpleNamespace(Thread=_NoThread, Lock=threading.Lock, Condition=threading.Condition)
    with monkeypatch.context() as mp:
        mp.setattr(disk_writer_mod, "threading", fake)
        opts = DiskOptions(path=tmp_path, namespace="il", block_bytes=64, capacity_bytes=64 * 64, queue_blocks=8)
        return disk_writer_mod.Writer(opts, CompletionQueue(), None, None, Tombs(None), 0,  # type: ignore[arg-type]
                                      lambda kind, msg: None, lambda: None)


def _disk_lock(w: disk_writer_mod.Writer) -> Any:
    return w._cond._lock


def _disk_consistent(w: disk_writer_mod.Writer, label: str) -> None:
    """The counts that go with the queue agree with it."""
    ops = list(w._ops)
    assert w.spills_queued == sum(type(o) is Spill for o in ops), f"{label}: spills_queued {w.spills_queued} for {ops}"
    assert w._touched == {o.key for o in ops if type(o) is Touch}, \
        f"{label}: _touched {w._touched} for the touches queued {ops} (a key there with none queued is never touched)"
    unsettled = w._tombs.unsettled
    assert all(o.token in unsettled for o in ops if type(o) is Spill), f"{label}: a spill queued unsettled"


def _one(ops: Any, op: Any) -> int:
    return sum(o is op for o in ops)


PUSHES = {
    "tomb_front": (lambda: Tomb(uuid.uuid4(), b"k1"), True),
    "delete_front": (lambda: Delete(uuid.uuid4(), b"k1"), True),
    "touch": (lambda: Touch(b"k1"), False),
    "flush": (lambda: Flush(uuid.uuid4(), 0), False),
}


@pytest.mark.parametrize("name", sorted(PUSHES))
def test_disk_writer_push_interrupted_anywhere(tmp_path: Any, monkeypatch: Any, name: str) -> None:
    """``Writer.push`` (DiskStore.cancel/submit_delete/submit_touch/submit_flush) with one op queued already:
    interrupted at any call return, the lock is free and ``op`` is queued once (at the front for a tomb or delete)
    or not at all, its counts with it; the retry of one not queued queues it."""
    make, front = PUSHES[name]

    def setup() -> Any:
        w = _disk_writer(tmp_path, monkeypatch)
        w.push(Touch(b"other"))
        return w, make()

    def call(st: Any) -> None:
        w, op = st
        w.push(op, front=front)

    def check(st: Any, label: str, _: Any) -> None:
        w, op = st
        _disk_consistent(w, label)
        n = _one(w._ops, op)
        assert n in (0, 1), f"{label}: queued {n} times"
        if n == 0:
            w.push(op, front=front)   # the caller's retry
            n = _one(w._ops, op)
            assert n == 1, f"{label}: the retry did not queue it"
            _disk_consistent(w, label + " (after the retry)")
        if front:
            assert w._ops[0] is op, f"{label}: not at the front"

    k = sweep(disk_writer_mod.Writer.push, setup, call, check, lambda st: _disk_lock(st[0]))
    assert k > 2


def test_disk_writer_push_to_a_closed_writer_interrupted_anywhere(tmp_path: Any, monkeypatch: Any) -> None:
    """A tomb pushed once the writer no longer accepts goes to the orphans close() applies: once or not at all."""
    def setup() -> Any:
        w = _disk_writer(tmp_path, monkeypatch)
        w.accepting = False
        return w, Tomb(uuid.uuid4(), b"k1")

    def check(st: Any, label: str, _: Any) -> None:
        w, op = st
        n = _one(w._orphans, op)
        assert n in (0, 1), f"{label}: kept {n} times"
        if n == 0:
            w.push(op, front=True)
            assert _one(w._orphans, op) == 1, f"{label}: the retry did not keep it"

    sweep(disk_writer_mod.Writer.push, setup, lambda st: st[0].push(st[1], front=True), check,
          lambda st: _disk_lock(st[0]))


@pytest.mark.parametrize("parts", [1, 3])
def test_disk_writer_submit_spills_interrupted_anywhere(tmp_path: Any, monkeypatch: Any, parts: int) -> None:
    """``Writer.submit_spills`` (a store's spills, ``DiskTier.start_spills``): all parts queued, counted and unsettled,
    or none; the retry of a job not queued queues it."""
    def setup() -> Any:
        w = _disk_writer(tmp_path, monkeypatch)
        w.push(Tomb(uuid.uuid4(), b"other"))
        toks = [uuid.uuid4() for _ in range(parts)]
        keys = [b"k%d" % i for i in range(parts)]
        srcs = [memoryview(bytearray(64)) for _ in range(parts)]
        return w, toks, keys, srcs

    def call(st: Any) -> Any:
        w, toks, keys, srcs = st
        return w.submit_spills(toks, keys, srcs)

    def check(st: Any, label: str, result: Any) -> None:
        w, toks, keys, srcs = st
        _disk_consistent(w, label)
        mine = [o for o in w._ops if type(o) is Spill and o.token in toks]
        assert len(mine) in (0, parts), f"{label}: {len(mine)} of the job's {parts} spills queued"
        if not mine:
            assert result is None, f"{label}: returned {result!r} with nothing queued"
            assert w.submit_spills(toks, keys, srcs), f"{label}: the retry was refused"
            mine = [o for o in w._ops if type(o) is Spill and o.token in toks]
            _disk_consistent(w, label + " (after the retry)")
        assert [o.token for o in mine] == toks, f"{label}: queued {mine}"

    k = sweep(disk_writer_mod.Writer.submit_spills, setup, call, check, lambda st: _disk_lock(st[0]))
    assert k > 3


def test_disk_writer_begin_close_interrupted_anywhere(tmp_path: Any, monkeypatch: Any) -> None:
    def check(w: Any, label: str, _: Any) -> None:
        if not w._closed:
            w.begin_close()
        assert w._closed

    sweep(disk_writer_mod.Writer.begin_close, lambda: _disk_writer(tmp_path, monkeypatch), lambda w: w.begin_close(),
          check, _disk_lock)


@pytest.mark.parametrize("step", ["acquire_shared", "release_shared"])
def test_rwlock_shared_interrupted_anywhere(step: str) -> None:
    """``RWLock.acquire_shared``/``release_shared`` (the owner's ``settle_orphans`` at close): the lock is free and
    the reader count moved by one or not at all."""
    def setup() -> RWLock:
        rw = RWLock()
        if step == "release_shared":
            rw.acquire_shared()
        return rw

    def check(rw: RWLock, label: str, _: Any) -> None:
        want = 1 if step == "acquire_shared" else 0
        assert rw._readers in (0, 1), f"{label}: {rw._readers} readers"
        if rw._readers != want:
            getattr(rw, step)()
        assert rw._readers == want, f"{label}: {rw._readers} readers after the retry"

    sweep(getattr(RWLock, step), setup, lambda rw: getattr(rw, step)(), check, lambda rw: rw._cond._lock)


# --------------------------------------------------------------------------------------------- the remote store
def _remote(monkeypatch: Any) -> tuple[RemoteWriter, Reader]:
    """A remote Writer and Reader without their threads (and without a connection: nothing is sent)."""
    monkeypatch.setattr(IOThread, "_start", lambda self: _NoThread())
    opts = RemoteOptions(url="redis://127.0.0.1:1", namespace="il", block_bytes=64, batch_blocks=64)
    brk = Breaker(3, 0.01, 1.0, lambda msg: None, lambda: None)
    out = CompletionQueue()
    names = KeyNames("il")
    w = RemoteWriter(opts, names, None, brk, out, lambda k, m: None, lambda why: None)  # type: ignore[arg-type]
    r = Reader(opts, names, None, brk, out, lambda k, m: None, lambda why: None, w.drop)  # type: ignore[arg-type]
    return w, r


def _remote_consistent(w: RemoteWriter, label: str) -> None:
    ops = list(w._ops)
    assert w.puts_pending == sum(type(o) is PutPart for o in ops), f"{label}: puts_pending {w.puts_pending} for {ops}"
    assert w.tombs_queued == sum(type(o) is TombOp for o in ops), f"{label}: tombs_queued {w.tombs_queued} for {ops}"
    inv: dict[bytes, int] = {}
    for o in ops:
        if type(o) is TombOp and o.kind == INVALIDATE:
            inv[o.key] = inv.get(o.key, 0) + 1
    assert w.invalidating == inv, f"{label}: invalidating {w.invalidating} for the INVALIDATE ops queued {inv}"


def test_remote_writer_submit_interrupted_anywhere(monkeypatch: Any) -> None:
    """``RemoteWriter.submit`` (``RemoteStore.submit_puts``): the job's parts all queued and counted, or none."""
    def setup() -> Any:
        w, _ = _remote(monkeypatch)
        toks = [uuid.uuid4() for _ in range(3)]
        return w, toks, [b"a", b"b", b"c"], [memoryview(bytearray(64)) for _ in range(3)]

    def check(st: Any, label: str, result: Any) -> None:
        w, toks, keys, views = st
        _remote_consistent(w, label)
        mine = [o for o in w._ops if type(o) is PutPart and o.token in toks]
        assert len(mine) in (0, 3), f"{label}: {len(mine)} of the job's 3 parts queued"
        if not mine:
            assert w.submit(toks, keys, views), f"{label}: the retry was refused"
            mine = [o for o in w._ops if type(o) is PutPart and o.token in toks]
            _remote_consistent(w, label + " (after the retry)")
        assert [o.token for o in mine] == toks

    k = sweep(RemoteWriter.submit, setup, lambda st: st[0].submit(*st[1:]), check, lambda st: st[0]._cond._lock)
    assert k > 3


@pytest.mark.parametrize("what", ["cancel", "invalidate"])
def test_remote_writer_tomb_ops_interrupted_anywhere(monkeypatch: Any, what: str) -> None:
    """``RemoteWriter.cancel``/``invalidate`` (``RemoteStore.cancel``/``invalidate``) with a put of the key queued:
    its tombstone op queued once or not at all, ``tombs_queued`` and ``invalidating`` with it (an INVALIDATE queued and
    not counted would let a fetch read the old value meanwhile); the retry of one not queued queues it."""
    kind = CANCEL if what == "cancel" else INVALIDATE

    def setup() -> Any:
        w, _ = _remote(monkeypatch)
        tok = uuid.uuid4()
        assert w.submit([tok], [b"k"], [memoryview(bytearray(64))])
        return w, tok

    def call(st: Any) -> None:
        w, tok = st
        if what == "cancel":
            w.cancel(tok, b"k")
        else:
            w.invalidate(b"k")

    def check(st: Any, label: str, _: Any) -> None:
        w, tok = st
        _remote_consistent(w, label)
        n = sum(type(o) is TombOp and o.kind == kind for o in w._ops)
        assert n in (0, 1), f"{label}: {n} {kind} ops queued"
        if n == 0:
            call(st)
            _remote_consistent(w, label + " (after the retry)")
            n = sum(type(o) is TombOp and o.kind == kind for o in w._ops)
        assert n == 1, f"{label}: {n} {kind} ops after the retry"

    sweep(getattr(RemoteWriter, what), setup, call, check, lambda st: st[0]._cond._lock)


@pytest.mark.parametrize("what", ["kick", "wake", "idle", "begin_close"])
def test_remote_io_thread_calls_interrupted_anywhere(monkeypatch: Any, what: str) -> None:
    def setup() -> Any:
        w, _ = _remote(monkeypatch)
        assert w.submit([uuid.uuid4()], [b"k"], [memoryview(bytearray(64))])
        return w

    def call(w: Any) -> Any:
        return w.begin_close(time.monotonic() + 1) if what == "begin_close" else getattr(w, what)()

    def check(w: Any, label: str, _: Any) -> None:
        _remote_consistent(w, label)
        call(w)   # returns

    sweep(getattr(IOThread, what), setup, call, check, lambda w: w._cond._lock)


def test_remote_wait_idle_interrupted_anywhere(monkeypatch: Any) -> None:
    """``wait_idle`` (a blocking flush's ``RemoteStore.wait_writes``) with a put queued and no thread to send it:
    interrupted anywhere -- inside ``Condition.wait`` too, as it gives its lock up or takes it back -- the lock is
    free, nothing but the interrupt comes out, and a later ``wait_idle`` returns False at its timeout."""
    def setup() -> Any:
        w, _ = _remote(monkeypatch)
        assert w.submit([uuid.uuid4()], [b"k"], [memoryview(bytearray(64))])
        return w

    def check(w: Any, label: str, result: Any) -> None:
        _remote_consistent(w, label)
        t0 = time.monotonic()
        assert w.wait_idle(0.01) is False
        assert time.monotonic() - t0 < 5, f"{label}: a later wait_idle overran its timeout"

    k = sweep(IOThread.wait_idle, setup, lambda w: w.wait_idle(0.01), check, lambda w: w._cond._lock)
    assert k > 3


@pytest.mark.parametrize("room_taken", [False, True], ids=["room", "room_taken"])
def test_remote_reader_submit_interrupted_anywhere(monkeypatch: Any, room_taken: bool) -> None:
    """``Reader.submit`` (``RemoteStore.submit_fetch``/``submit_probe``): the job queued with its room or not at all
    (with ``room_taken`` the room stays held either way: the caller's retry, or its give_room, settles it)."""
    def setup() -> Any:
        _, r = _remote(monkeypatch)
        if room_taken:
            assert r.take_room(2)
        return r, uuid.uuid4()

    def call(st: Any) -> Any:
        r, tok = st
        return r.submit(tok, [b"a", b"b"], [memoryview(bytearray(64)), memoryview(bytearray(64))],
                        room_taken=room_taken)

    def check(st: Any, label: str, _: Any) -> None:
        r, tok = st
        mine = [j for j in r._jobs if j.token == tok]
        assert len(mine) in (0, 1), f"{label}: queued {len(mine)} times"
        assert r.parts_pending == (2 if mine or room_taken else 0), f"{label}: parts_pending {r.parts_pending}"
        if not mine:
            assert call(st), f"{label}: the retry was refused"
            assert len([j for j in r._jobs if j.token == tok]) == 1 and r.parts_pending == 2, label

    sweep(Reader.submit, setup, call, check, lambda st: st[0]._cond._lock)


@pytest.mark.parametrize("what", ["take_room", "give_room"])
def test_remote_reader_room_interrupted_anywhere(monkeypatch: Any, what: str) -> None:
    def setup() -> Any:
        _, r = _remote(monkeypatch)
        if what == "give_room":
            assert r.take_room(2)
        return r

    def check(r: Any, label: str, _: Any) -> None:
        want = 2 if what == "take_room" else 0
        assert r.parts_pending in (0, 2), f"{label}: parts_pending {r.parts_pending}"
        if r.parts_pending != want:
            getattr(r, what)(2)
        assert r.parts_pending == want, label

    sweep(getattr(Reader, what), setup, lambda r: getattr(r, what)(2), check, lambda r: r._cond._lock)


# --------------------------------------------------------------------------------------------- with the real threads
@pytest.mark.parametrize("at", ["_is_owned", "release"])
def test_a_wake_up_cut_off_in_notify_only_delays_a_flush(tmp_path: Any, monkeypatch: Any, at: str) -> None:
    """The disk writer (its real thread, idle in its timed wait) and a flush pushed on the engine's thread, interrupted
    inside ``Condition.notify`` -- before it releases the writer's waiter (``_is_owned``: no wake-up at all) or right
    after (``release``: a waiter left in the list, gh-92530) --: the flush is queued, the lock is free, and the
    writer still answers it (at its next timed wake at the latest); a later flush is answered too."""
    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)
    w = World(31, str(tmp_path / "disk"))
    m = w.mgr
    try:
        writer = m._core.disk.store.writer
        q = m._completions._q
        deadline = time.monotonic() + 10
        while not writer._cond._waiters and time.monotonic() < deadline:   # (waits for the writer's first wait only)
            time.sleep(0.001)
        assert writer._cond._waiters, "the writer never waited"
        hook, seen = _interrupt_in_notify(at)
        tok = uuid.uuid4()
        _, exc = _call_with(hook, lambda: writer.push(Flush(tok, writer.failures)))
        assert seen and isinstance(exc, KeyboardInterrupt), (seen, exc)
        _lock_free(writer._cond._lock, f"push interrupted in notify at {at}")
        for t in (tok, None):
            if t is None:
                t = uuid.uuid4()
                writer.push(Flush(t, writer.failures))
            got = q.get(timeout=10)
            assert isinstance(got, FlushDone) and got.token == t and got.ok, got
    finally:
        m.close()


def test_disk_sweep_of_invalidate_never_leaves_the_writer_locked(tmp_path: Any, monkeypatch: Any) -> None:
    """The manager: ``invalidate(k1)`` with a disk tier (round 31's ``prepare_disk``) interrupted at every call return
    inside ``DiskStore.cancel``/``submit_delete`` -> ``Writer.push`` (threading.py's frames included): the writer's
    lock is free afterwards and ``check_disk`` holds (every job reported once, nothing leaked, ready keys load)."""
    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)
    n = 0
    for k in range(1, MAX_K):
        w = World(29, str(tmp_path / f"d{k}"))
        m = w.mgr
        lock = m._core.disk.store.writer._cond._lock
        leaked = False
        try:
            prepare_disk(w)
            hook, fired = _interrupt_inside(disk_writer_mod.Writer.push, k)
            _, exc = _call_with(hook, lambda: ACTIONS["invalidate"](w))
            assert exc is None or isinstance(exc, KeyboardInterrupt), f"k={k}: raised {exc!r}"
            got = lock.acquire(timeout=1.0)
            if got:
                lock.release()
            leaked = not got
            assert got, f"invalidate interrupted at {fired}: the disk writer's lock stays held"
            if fired:
                ACTIONS["invalidate"](w)   # the caller's retry
            check_disk(w, f"invalidate interrupted at {fired}")
        finally:
            if leaked:
                lock.release()
            m.close()
        n += 1
        if not fired:
            break
    assert n > 3


@pytest.mark.parametrize("at", ["_is_owned", "release"])
def test_a_wake_up_cut_off_in_kick_only_delays_a_put(redis_url: str, at: str) -> None:
    """The remote writer (its real thread, idle) and a put of one part (below ``batch_blocks``: only the kick wakes
    the thread), the kick interrupted inside ``Condition.notify_all`` -- before it releases the thread's waiter
    (``_is_owned``: no wake-up at all) or right after (``release``) --: the lock is free, and the put is still sent
    and answered with no further call of the owner (the idle thread looks again after ``IDLE_WAKE_S``; before the
    fix its idle wait had no timeout and the put waited for the owner's next call)."""
    from tiered_kv.remote.store import RemoteStore

    q = CompletionQueue()
    store = RemoteStore(RemoteOptions(url=redis_url, namespace="il", block_bytes=64, timeout_s=2.0, batch_blocks=8), q)
    try:
        w = store._w
        deadline = time.monotonic() + 10
        while not w._cond._waiters and time.monotonic() < deadline:   # (waits for the thread's first wait only)
            time.sleep(0.001)
        assert w._cond._waiters, "the remote writer thread never waited"
        tok = uuid.uuid4()
        assert store.submit_puts([tok], [b"k"], [memoryview(bytearray(64))])
        hook, seen = _interrupt_in_notify(at)
        _, exc = _call_with(hook, w.kick)
        assert seen and isinstance(exc, KeyboardInterrupt), (seen, exc)
        _lock_free(w._cond._lock, f"kick interrupted in notify at {at}")
        r = q.get(10.0)   # no further call of the owner's
        assert r is not None, "the put was never sent: its wake-up was lost for good"
        assert r.token == tok and r.ok, r
    finally:
        store.close(timeout=2.0)
