"""Review of the job/token layer and the API boundary (jobs.py, reports.py, untrack.py, checks.py, and how
manager.py uses them).

What it proved wrong, each pinned by a test that failed before its fix: ``wait(timeout)`` waited past
its deadline, until some report came, when a signal handler ran during its timed get and outlasted the
time left (CPython's ``SimpleQueue.get`` then waits without a limit); ``get_within`` raised
OverflowError for an infinite timeout; a bool tensor passed as a row; a set or dict of keys or rows
was taken (paired in hash order: one key's bytes stored as another's); a bytearray or memoryview given
as the keys argument was refused naming a byte; a repeat at the end of a huge batch was refused in
quadratic time.  The plain tests pin behaviours checked and found correct, each chosen so that it
fails if the code it guards breaks.  Interleavings are forced with a fake mover and events; no test
asserts a duration (a watchdog and a test timeout guard the two that could hang).
"""

from __future__ import annotations

import copy
import math
import pickle
import queue
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from fakes import fill_row, host_matches, instrument_get, make_config, make_fake_manager, make_kv, mgr_metric
from tiered_kv.errors import InvalidBlockError, InvalidKeyError
from tiered_kv.jobs import ALLOWED_MOVES, Job, JobKind, JobState, TokenFactory, uuid_from_int
from tiered_kv.reports import get_within

_MASK48 = (1 << 48) - 1


def _ready(mgr, mover, kv, key: bytes, row: int) -> None:
    """``key`` READY on the host (stored from ``row``, the row freed after)."""
    fill_row(kv, row, key)
    job = mgr.store(key, row)
    assert job is not None
    mover.complete(job)
    mgr.poll()
    assert mgr.free_block(row)


# ============================================================================ defects (xfail, strict)
@pytest.mark.parametrize("op", ["store", "store_many", "load", "free_block"])
def test_a_bool_tensor_is_refused_as_a_block_like_a_bool(fake, kv, op):
    """``True`` is refused as a row (checks.check_block: "block must be an int, got bool"), but its tensor
    twin -- what ``mask[i]`` or ``(ids == x)[0]`` gives an engine -- passes ``operator.index`` as 1: a store
    reads row 1, a load overwrites row 1, and ``free_block`` gives up row 1, cancelling the store reading
    it.  Refused, nothing may change."""
    mgr, mover = fake
    fill_row(kv, 1, b"on-row-1")
    pending = mgr.store(b"on-row-1", 1)          # a store reading row 1
    _ready(mgr, mover, kv, b"ready", 7)
    bad = torch.tensor(True)
    call = {"store": lambda: mgr.store(b"new", bad),
            "store_many": lambda: mgr.store_many([b"new"], [bad]),
            "load": lambda: mgr.load(b"ready", bad),
            "free_block": lambda: mgr.free_block(bad)}[op]
    try:
        with pytest.raises(InvalidBlockError, match="bool|True"):
            call()
    finally:
        assert pending.state is JobState.PENDING   # row 1's store was not given up / overwritten


@pytest.mark.parametrize("call", ["store_many", "load_many"])
@pytest.mark.parametrize("which", ["set_keys", "dict_blocks", "set_blocks"])
def test_an_unordered_batch_is_refused(fake, kv, call, which):
    """``store_many(keys, blocks)`` stores ``keys[i]`` from row ``blocks[i]``: the pairing needs both in a
    defined order.  ``checks._as_list`` takes any non-str/bytes iterable, so a set of keys is paired with
    the rows in the set's (hash-seed dependent) order -- block A's bytes stored under key B, served later
    as B: the one thing the cache may never do -- and a dict of rows contributes its keys, not its values.
    The error message already says "must be a sequence"; a set or mapping is not one."""
    mgr, mover = fake
    for i, k in enumerate((b"a", b"b")):
        _ready(mgr, mover, kv, k, 10 + i)
    keys: object = [b"x", b"y"] if call == "store_many" else [b"a", b"b"]
    blocks: object = [0, 1]
    if which == "set_keys":
        keys = set(keys)  # type: ignore[arg-type]
    elif which == "dict_blocks":
        blocks = {0: 5, 1: 6}
    else:
        blocks = {0, 1}
    with pytest.raises((InvalidKeyError, InvalidBlockError), match="sequence"):
        getattr(mgr, call)(keys, blocks)


@pytest.mark.parametrize("arg", [bytearray(b"ab"), memoryview(b"ab")], ids=["bytearray", "memoryview"])
@pytest.mark.parametrize("call", ["store_many", "load_many", "lookup"])
def test_a_bytes_like_keys_argument_is_named_in_the_error(fake, call, arg):
    """``keys=b"ab"`` is refused naming it ("keys must be a sequence, got bytes: b'ab'"), because one key
    passed where a list of keys was meant is an easy slip.  The same slip with a bytearray or memoryview
    key -- both refused as keys by name elsewhere -- is iterated as ints, and the error is about ``97``."""
    mgr, _ = fake
    fn = {"store_many": lambda: mgr.store_many(arg, [0, 1]), "load_many": lambda: mgr.load_many(arg, [0, 1]),
          "lookup": lambda: mgr.lookup(arg)}[call]
    with pytest.raises(InvalidKeyError) as ei:
        fn()
    assert type(arg).__name__ in str(ei.value), str(ei.value)


@pytest.mark.timeout(60)   # a hang guard, not a timing assert: quadratic, 300k keys take minutes; linear, a second
@pytest.mark.parametrize("repeat", ["key", "block"])
def test_a_repeat_at_the_end_of_a_huge_batch_is_refused_in_linear_time(repeat):
    """check_many named the first repeat by slicing the list before each element (``k in ks[:i]``): O(n^2)
    on the engine thread to raise an error (30k keys took seconds, 100k about 30 s).  Named by a set now."""
    n = 300_000
    mgr, _ = make_fake_manager(make_config(8), make_kv(n + 1))
    keys = [b"k%d" % i for i in range(n)]
    rows = list(range(n))
    try:
        if repeat == "key":
            with pytest.raises(InvalidKeyError, match=f"key {keys[-1]!r} appears twice"):
                mgr.store_many(keys + [keys[-1]], rows + [n])
        else:
            with pytest.raises(InvalidBlockError, match=f"block {n - 1} appears twice"):
                mgr.store_many(keys + [b"k-last"], rows + [n - 1])
        assert mgr.jobs_in_flight == 0
    finally:
        mgr.close()


def test_get_within_an_infinite_timeout_waits_instead_of_raising():
    """``get_within``'s contract: None blocks, ``<= 0`` does not wait, anything else waits that long.  An
    infinite (or any > ~9e9 s) timeout reaches ``SimpleQueue.get(timeout=inf)``, which raises
    ``OverflowError: timestamp out of range`` -- not Empty, not a tiered_kv error.  ``check_timeout``
    turns a huge int into ``math.inf`` on purpose ("as long as inf"), and ``SlabCopier.wait`` hands its
    remaining time to ``get_within`` unchecked.

    The queue below is empty when ``get_within`` looks without waiting and holds a report when it waits
    (a put in between, forced rather than timed)."""

    class ArrivesWhileWaiting:
        def __init__(self) -> None:
            self.q: queue.SimpleQueue = queue.SimpleQueue()
            self.q.put("report")

        def get_nowait(self):
            raise queue.Empty

        def get(self, *a, **kw):
            return self.q.get(*a, **kw)

    assert get_within(ArrivesWhileWaiting(), math.inf) == "report"   # type: ignore[arg-type]


def test_wait_keeps_its_timeout_when_a_signal_handler_runs_during_the_wait(fake, kv):
    """``get_within`` exists because CPython's ``SimpleQueue.get(timeout)`` can wait for ever once the time
    left goes negative inside its loop.  It still does when the wait is interrupted by a signal: on EINTR
    CPython runs the Python handler, marks the lock held, recomputes the time left -- negative if the
    handler ran past the deadline -- and waits again with that negative timeout, i.e. without one.

    Here the engine thread waits 0.5 s for a job that is not answered; a SIGUSR1 handler (a stack dumper,
    a metrics flush, a graceful-shutdown hook...) runs 0.1 s into the timed get and takes 0.6 s.  wait()
    should return at about 1.1 s; broken, it returned only when some report arrived -- the watchdog's, 3 s
    in (without it: never; a CUDA mover's reports come only from the waiting thread's own queries).  The
    test asserts that wait() returned without the watchdog's report, not a duration.  (The signal must
    land inside the timed get to show the defect: the 0.1 s delay puts it there.)"""
    mgr, mover = fake
    fill_row(kv, 0, b"slow")
    job = mgr.store(b"slow", 0)
    assert threading.current_thread() is threading.main_thread()
    main = threading.main_thread().ident
    entering = threading.Event()

    def handler(signum, frame):
        time.sleep(0.6)

    def interrupter() -> None:
        if entering.wait(30):           # the owner entered the timed get: 0.1 s on it waits in C
            time.sleep(0.1)
            signal.pthread_kill(main, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, handler)
    fired = threading.Event()

    def wake() -> None:   # an unknown-token report: it wakes a get blocked without a deadline
        fired.set()
        mover.inject()

    watchdog = threading.Timer(3.0, wake)
    th = threading.Thread(target=interrupter, daemon=True)
    try:
        instrument_get(mover.completions, lambda timeout: entering.set())
        watchdog.start()
        th.start()
        mgr.wait([job], timeout=0.5)
        watchdog.cancel()
        needed_the_watchdog = fired.is_set()
    finally:
        watchdog.cancel()
        th.join(30)
        signal.signal(signal.SIGUSR1, old)
    assert not job.done
    assert not needed_the_watchdog, "wait(timeout=0.5) kept waiting past its deadline until a report came"


# ============================================================================ checked, correct (plain tests)
def test_tokens_are_version4_uuids_a_counter_under_a_random_prefix_and_wrap_to_a_fresh_prefix():
    """TokenFactory: the low 48 bits count from ``start``; the prefix carries version 4 and the RFC 4122
    variant (set once); two factories differ in their 74 random bits; at 2**48 the factory starts again
    under a fresh prefix, so the counter never runs into the prefix's bits (where a wrapped counter would
    collide with an earlier token or break the version)."""
    f = TokenFactory(start=5)
    a, b = f(), f()
    assert (a.int & _MASK48, b.int & _MASK48) == (5, 6)
    assert a.int >> 48 == b.int >> 48
    for t in (a, b):
        assert t.version == 4 and t.variant == uuid.RFC_4122
    assert TokenFactory(start=0)().int & _MASK48 == 1 and TokenFactory(start=-9)().int & _MASK48 == 1
    assert len({TokenFactory()().int >> 48 for _ in range(64)}) == 64
    g = TokenFactory(start=_MASK48)
    last, wrapped, after = g(), g(), g()
    assert last.int & _MASK48 == _MASK48
    assert (wrapped.int & _MASK48, after.int & _MASK48) == (1, 2)
    assert wrapped.int >> 48 != last.int >> 48 and after.int >> 48 == wrapped.int >> 48
    assert len({last, wrapped, after}) == 3
    for t in (last, wrapped, after):
        assert t.version == 4 and t.variant == uuid.RFC_4122


def test_a_token_made_by_uuid_from_int_is_a_full_uuid():
    """Tokens skip ``UUID.__init__``: they must still be equal, hash, print, pickle and copy like the UUID
    of the same int (dicts keyed by either, the disk headers, the pipes to the I/O process)."""
    t = TokenFactory()()
    ref = uuid.UUID(int=t.int)
    assert t == ref and hash(t) == hash(ref) and str(t) == str(ref) and t.bytes == ref.bytes
    assert {ref: 1}[t] == 1 and uuid.UUID(str(t)) == t
    for twin in (pickle.loads(pickle.dumps(t)), copy.copy(t), copy.deepcopy(t), uuid_from_int(ref.int)):
        assert twin == t and hash(twin) == hash(t) and str(twin) == str(t)
    with pytest.raises(TypeError):
        t.int = 5   # immutable like any UUID


def test_the_state_table_is_the_documented_one_and_move_refuses_everything_else():
    """jobs.ALLOWED_MOVES is the table of docs/architecture.md: PENDING -> DONE/FAILED/CANCELLING,
    CANCELLING -> CANCELLED, nothing out of a terminal state; ``Job._move`` raises on any other move and
    leaves the state as it was."""
    S = JobState
    want = {S.PENDING: {S.DONE, S.FAILED, S.CANCELLING}, S.CANCELLING: {S.CANCELLED},
            S.DONE: set(), S.FAILED: set(), S.CANCELLED: set()}
    assert {k: set(v) for k, v in ALLOWED_MOVES.items()} == want
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.CANCELLED}
    for src in S:
        for dst in S:
            job = Job(uuid.uuid4(), JobKind.STORE, b"k", 0, state=src)
            if dst in want[src]:
                job._move(dst)
                assert job.state is dst and job.done is dst.terminal
            else:
                with pytest.raises(AssertionError):
                    job._move(dst)
                assert job.state is src


def test_tokens_are_issued_in_the_order_made_and_a_refused_stores_token_goes_to_the_next_job(kv):
    """A store refused after it took its token (host full: every slot leased) puts it back at the front of
    the pool: the next job takes it, so the jobs of a run get consecutive counters, none twice and none
    skipped -- across refusals that take a token (``store``/``store_many`` host_full), refusals that take
    none (a key being stored) and the pool's top-ups at poll()."""
    mgr, mover = make_fake_manager(make_config(4), kv)
    issued: list[Job] = []

    def store(key: bytes, row: int) -> Job | None:
        fill_row(kv, row, key)
        job = mgr.store(key, row)
        if job is not None:
            issued.append(job)
        return job

    try:
        for i in range(4):                                  # every host slot leased to a pending store
            assert store(b"k%d" % i, i) is not None
        assert store(b"h1", 10) is None                     # host_full: token taken, given back
        assert mgr.store_many([b"h2", b"h3"], [11, 12]) is None
        assert store(b"k0", 13) is None                     # being stored: no token taken
        mgr.poll()                                          # the pool is topped up behind what is left in it
        mover.complete(issued[0])
        mgr.poll()
        load = mgr.load(b"k0", 20)                          # k0 READY, now leased: still nothing evictable
        assert load is not None
        issued.append(load)
        assert store(b"h4", 14) is None
        mover.complete(issued[1])
        mgr.poll()
        assert store(b"h1", 10) is not None                 # evicts k1
        assert mgr.store_many([b"h5", b"h6"], [15, 16]) is None
        for i in range(5):                                  # more steps, more top-ups of the pool
            mover.complete_all()
            mgr.poll()
            assert mgr.free_block(30)
            assert store(b"n%d" % i, 30) is not None
        counters = [j.token.int & _MASK48 for j in issued]
        assert counters == list(range(counters[0], counters[0] + len(counters))), counters
        assert len({j.token.int >> 48 for j in issued}) == 1 and len({j.token for j in issued}) == len(issued)
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 6
    finally:
        mgr.close()


def test_store_many_keeps_its_own_copy_of_the_callers_lists_and_pairs_iterators_in_order(fake, kv):
    """``store_many`` copies its arguments (checks._as_list): the engine reusing its lists after the call
    changes neither ``job.keys``/``job.blocks`` nor which part a later ``free_block`` cancels.  Generators
    and numpy rows are paired in order, the rows turned into ints."""
    mgr, mover = fake
    keys, rows = [b"a", b"b", b"c"], [0, 1, 2]
    for k, r in zip(keys, rows):
        fill_row(kv, r, k)
    job = mgr.store_many(keys, rows)
    keys[0], rows[0] = b"zz", 9
    rows.append(3)
    assert list(job.keys) == [b"a", b"b", b"c"] and list(job.blocks) == [0, 1, 2]
    assert mgr.free_block(9) is True and job.state is JobState.PENDING   # the caller's new row 9: nothing of ours
    assert mgr.free_block(0) is True                                    # row 0 still cancels key a's part
    mover.complete(job)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert host_matches(mgr, b"a", kv) is None and host_matches(mgr, b"b", kv) and host_matches(mgr, b"c", kv)

    for k, r in ((b"g0", 40), (b"g1", 41)):
        fill_row(kv, r, k)
    gen = mgr.store_many((k for k in (b"g0", b"g1")), np.array([40, 41], dtype=np.int32))
    assert list(gen.blocks) == [40, 41] and all(type(b) is int for b in gen.blocks)
    mover.complete(gen)
    mgr.poll()
    assert host_matches(mgr, b"g0", kv) and host_matches(mgr, b"g1", kv)


def test_a_report_whose_token_is_not_a_uuid_is_counted_unknown_and_touches_no_job(fake, kv):
    """TierCore.apply matches by ``token.int``; a report from a foreign or broken worker whose token is
    raw bytes (or an int) has no ``.int``: it is discarded and counted ``unknown_token``, never raised in
    the engine's poll(), and the live job it resembles is reported once, by its own report."""
    mgr, mover = fake
    fill_row(kv, 0, b"a")
    job = mgr.store(b"a", 0)
    mover.inject(token=job.token.bytes)            # type: ignore[arg-type]
    mover.inject(token=job.token.int)              # type: ignore[arg-type]
    assert mgr.poll() == [] and job.state is JobState.PENDING
    assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="store", reason="unknown_token") == 2
    mover.complete(job)
    assert [(c.job, c.ok) for c in mgr.poll()] == [(job, True)]
    mover.duplicate(job)
    assert mgr.poll() == []
    assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="store", reason="unknown_token") == 3


def test_get_within_returns_an_item_put_while_it_waits_and_times_out_on_time():
    """The timed path of get_within after its non-blocking look: a put while it waits is returned (not
    Empty), and with nothing put it raises Empty once its timeout has passed, not much later."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    waiting = threading.Event()

    class Probe:
        def get_nowait(self):
            try:
                return q.get_nowait()
            finally:
                waiting.set()

        def get(self, *a, **kw):
            return q.get(*a, **kw)

    def producer() -> None:
        waiting.wait(30)
        q.put("late")

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    assert get_within(Probe(), 30.0) == "late"     # type: ignore[arg-type]
    th.join(30)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        get_within(q, 0.05)
    assert 0.04 <= time.monotonic() - t0 < 5.0
