"""Review of the wake-up cost changes (c4b2210, e4e71f1): what they keep and what they break.

Checked to hold (plain tests, each fails if the guarantee breaks):

* ``get_within`` (the C ``pthread_sigmask``): the calling thread's signal mask is exactly what it was
  after a timed wait (a signal the caller blocked stays blocked, none is left blocked), on the main
  thread and on another thread; a signal raised during a slice is held off (pending, its handler not
  run) and handled before ``get_within`` returns; where ``_signal`` lacks ``pthread_sigmask`` the module
  falls back to ``signal.pthread_sigmask`` and still restores the mask.
* ``_block_until`` without the first pass's publication: the registry is exact when ``wait()`` returns
  on its timeout and when a ``KeyboardInterrupt`` leaves it from inside its blocking get.
* ``needs_harvest``: with ``CudaMover`` (simulated device) the owner never blocks longer than a slice
  while a copy is queued or on the device; with ``NativeMover`` it never blocks at all while a transfer
  is held or in flight, also when the owner's own copy of a batch fails and the batch is started again
  a transfer at a time in the inter-op threads.

What it proved wrong (each test failed before its fix):

* ``test_a_fetch_started_by_a_probe_report_is_sent_before_the_owner_sleeps`` (e4e71f1): with a polled
  mover idle the blocked owner slept up to ``_WAKE_S`` between reports, so remote work it queued while
  applying a report in an inner pass (the fetch a probe's answer starts) waited for a kick only a full
  pass gave: ``wait()`` took 50-500 ms longer.  Fixed: an inner pass kicks the stores (``TierCore.kick``),
  and the owner wakes each slice while the disk I/O process's pipe holds ops back (``TierCore.unsent``).
* ``test_a_report_taken_in_a_slice_survives_a_handler_that_raises_at_the_mask_restore`` (older than
  c4b2210): a signal held off during the slice that took a report was handled in the ``finally`` that
  restores the mask; a handler that raised (Ctrl-C) dropped the report, so its job was never reported.
  Fixed: the report goes to the consumer's ``kept`` deque before the mask is restored
  (``get_within``, ``CompletionQueue``, ``SlabCopier``).
"""

from __future__ import annotations

import importlib.util
import queue
import signal
import sys
import threading
import time
import types
from typing import Any, Callable, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from fakes import FakeMover, fill_row, instrument_get, make_config, make_kv, row_matches, sample
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv import manager as manager_mod
from tiered_kv import reports as reports_mod
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CudaMover, NativeMover, native_available
from tiered_kv.reports import get_within

SLICE_S = 0.0005   # _block_until's slice for a polled mover
HANG_S = 30.0      # a watchdog only: generous bounds on waits that must not hang


def _mask() -> set[int]:
    """This thread's signal mask, as ints (SIG_BLOCK of nothing changes nothing)."""
    return {int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])}


class _SignalInGet:
    """A ``SimpleQueue`` stand-in for ``get_within``: empty until its timed ``get``, which puts ``item``,
    raises ``signum`` at the calling thread (held off there: pending), runs ``during()``, then takes the
    item.  ``put``/``qsize`` delegate, so a ``CompletionQueue`` can carry it."""

    def __init__(self, signum: int, item: Any = None, during: Optional[Callable[[], None]] = None,
                 before: Optional[Callable[[], None]] = None) -> None:
        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.signum, self.item, self.during, self.before = signum, item, during, before
        self.armed = True
        self.timed_gets = 0

    def put(self, item: Any) -> None:
        self.q.put(item)

    def qsize(self) -> int:
        return self.q.qsize()

    def get_nowait(self) -> Any:
        return self.q.get_nowait()

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        self.timed_gets += 1
        if self.armed:
            self.armed = False
            if self.before is not None:
                self.before()            # e.g. a worker's report put now, while the slice waits
            if self.item is not None:
                self.q.put(self.item)
            signal.pthread_kill(threading.get_ident(), self.signum)
            if self.during is not None:
                self.during()
        return self.q.get(timeout=timeout)


@pytest.fixture
def usr1() -> Any:
    """SIGUSR1's handler for the test (restored after); nothing of it left pending or blocked."""
    before_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    old = signal.getsignal(signal.SIGUSR1)
    calls: list[int] = []

    def install(handler: Optional[Callable[[int, Any], None]] = None) -> list[int]:
        def record(signum: int, frame: Any) -> None:
            calls.append(signum)
            if handler is not None:
                handler(signum, frame)
        signal.signal(signal.SIGUSR1, record)
        return calls

    try:
        yield install
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # anything still pending is dropped
        signal.pthread_sigmask(signal.SIG_SETMASK, before_mask)
        signal.signal(signal.SIGUSR1, old)


# --------------------------------------------------------------------------- 1. get_within's mask

def test_a_timed_wait_leaves_the_callers_mask_exactly_as_it_was():
    """A signal the caller blocked itself stays blocked after a timed wait (the restore sets the old mask,
    it does not unblock the held-off set), and nothing the wait held off stays blocked."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        mine = _mask()
        assert int(signal.SIGUSR2) in mine and int(signal.SIGUSR1) not in mine
        q: "queue.SimpleQueue[str]" = queue.SimpleQueue()
        with pytest.raises(queue.Empty):
            get_within(q, 0.001)
        assert _mask() == mine
        q.put("report")
        assert get_within(q, HANG_S) == "report"   # (taken by get_nowait: no slice)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        with pytest.raises(queue.Empty):
            get_within(q, 0.001)
        assert _mask() == set()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_signal_raised_during_a_slice_is_held_off_then_handled_before_the_wait_returns(usr1):
    """Held off during the slice (pending, its handler not run), handled by the mask's restore: before
    ``get_within`` returns the report the slice took."""
    calls = usr1()
    seen: dict[str, Any] = {}

    def during() -> None:
        seen["pending"] = int(signal.SIGUSR1) in {int(s) for s in signal.sigpending()}
        seen["calls"] = len(calls)

    q = _SignalInGet(signal.SIGUSR1, "report", during)
    assert get_within(q, HANG_S) == "report"
    assert seen == {"pending": True, "calls": 0}
    assert calls == [int(signal.SIGUSR1)]
    assert int(signal.SIGUSR1) not in _mask()


def test_a_timed_wait_on_another_thread_restores_that_threads_mask_and_leaves_mains_alone():
    main_before = _mask()
    out: dict[str, Any] = {}

    def worker() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        out["before"] = _mask()
        q: "queue.SimpleQueue[str]" = queue.SimpleQueue()
        try:
            get_within(q, 0.001)
        except queue.Empty:
            out["empty"] = True
        out["after"] = _mask()

    t = threading.Thread(target=worker)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive()
    assert out.get("empty") and out["after"] == out["before"] and int(signal.SIGUSR2) in out["after"]
    assert _mask() == main_before


def test_without_the_c_function_the_module_falls_back_to_signals_and_still_restores_the_mask(monkeypatch):
    """A ``_signal`` without ``pthread_sigmask`` (ImportError on the name): ``_sigmask`` is the public
    wrapper, and a timed wait through that copy of the module restores the mask."""
    monkeypatch.setitem(sys.modules, "_signal", types.ModuleType("_signal"))
    name = "tiered_kv._review_reports_copy"
    spec = importlib.util.spec_from_file_location(name, reports_mod.__file__)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    assert mod._sigmask is signal.pthread_sigmask
    assert mod._HELD_OFF == reports_mod._HELD_OFF
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        mine = _mask()
        with pytest.raises(queue.Empty):
            mod.get_within(queue.SimpleQueue(), 0.001)
        assert _mask() == mine
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert reports_mod._sigmask is not signal.pthread_sigmask   # the real module kept the C function


def _fake_manager(rows: int = 8, **cfg: Any) -> tuple[TierManager, list[FakeMover], torch.Tensor]:
    kv = make_kv(rows)
    movers: list[FakeMover] = []

    def factory(d: torch.Tensor, h: torch.Tensor, q: Any) -> FakeMover:
        movers.append(FakeMover(d, h, q))
        return movers[-1]

    mgr = TierManager(make_config(8, **cfg), kv, registry=CollectorRegistry(), mover_factory=factory)
    return mgr, movers, kv


def test_a_report_taken_in_a_slice_survives_a_handler_that_raises_at_the_mask_restore(usr1):
    """Ctrl-C while ``wait()`` blocks: the store's report arrives in the same slice as the signal.  The
    slice's ``q.get`` returns it, the ``finally`` restores the mask, the handler raises, and the report --
    already off the queue -- is lost: the job stays PENDING for good, with no transfer outstanding, and
    every later ``wait([job])`` runs to its timeout."""
    usr1(signal.default_int_handler)   # raises KeyboardInterrupt, as Ctrl-C's handler does
    mgr, movers, kv = _fake_manager()
    try:
        fill_row(kv, 0, b"k")
        job = mgr.store(b"k", 0)
        assert job is not None
        mover = movers[0]
        hooked = _SignalInGet(signal.SIGUSR1, before=lambda: mover.complete(job))
        mgr._completions._q = hooked   # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            mgr.wait([job], timeout=HANG_S)
        assert hooked.timed_gets == 1 and not mover.outstanding   # answered by the worker
        mgr.poll()
        assert job.done, "the store's report was taken off the queue and dropped: the job is never reported"
    finally:
        mgr.close()


# --------------------------------------------------------------------------- 2. the gauges' passes

def _host_blocks_published(mgr: TierManager) -> float:
    return sample(mgr.metrics.registry, "tiered_kv_tier_blocks", tier="host")


def _stores_ok_published(mgr: TierManager) -> float:
    return sample(mgr.metrics.registry, "tiered_kv_jobs_total", kind="store", outcome="ok")


def test_a_wait_that_times_out_leaves_the_registry_exact():
    """The first pass applies a store's report without publishing; the wait then times out on another
    job: its last pass publishes what the first applied."""
    mgr, movers, kv = _fake_manager()
    try:
        fill_row(kv, 0, b"a")
        fill_row(kv, 1, b"b")
        a, b = mgr.store(b"a", 0), mgr.store(b"b", 1)
        movers[0].complete(a)
        gets: list[Any] = []
        instrument_get(mgr._completions, gets.append)
        mgr.wait([b], timeout=0.001)
        assert a.done and not b.done
        assert _host_blocks_published(mgr) == mgr.host_blocks == 2   # a published, b being written
        assert _stores_ok_published(mgr) == 1
    finally:
        mgr.close()


def test_an_interrupt_inside_a_wait_still_leaves_the_registry_exact():
    """A KeyboardInterrupt out of the blocking get: the ``finally``'s last pass publishes what the first
    pass applied (it published nothing itself)."""
    mgr, movers, kv = _fake_manager()
    try:
        fill_row(kv, 0, b"a")
        fill_row(kv, 1, b"b")
        a, b = mgr.store(b"a", 0), mgr.store(b"b", 1)
        movers[0].complete(a)
        before = _host_blocks_published(mgr)

        def interrupt(timeout: Any) -> None:
            raise KeyboardInterrupt

        instrument_get(mgr._completions, interrupt)
        with pytest.raises(KeyboardInterrupt):
            mgr.wait([b], timeout=HANG_S)
        assert before == 0 and a.done
        assert _host_blocks_published(mgr) == mgr.host_blocks == 2   # a published, b being written
        assert _stores_ok_published(mgr) == 1
    finally:
        mgr.close()


# --------------------------------------------------------------------------- 3. needs_harvest

def test_with_a_cuda_mover_the_owner_sleeps_no_longer_than_a_slice_while_a_copy_is_queued_or_on_the_device():
    gpu = FakeGPU()
    made: list[CudaMover] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, out: Any) -> CudaMover:
        made.append(CudaMover([(dev, host)], out, 1, runtime=gpu, batch_max=8))
        return made[-1]

    kv = make_kv(8)
    mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        m = made[0]
        for i in range(3):
            fill_row(kv, i, b"k%d" % i)
        jobs = [mgr.store(b"k%d" % i, i) for i in range(3)]
        log: list[tuple[float, int]] = []

        def on_enter(timeout: Any) -> None:
            log.append((timeout, m.in_flight()))
            if len(log) == 3:
                gpu.run_all()   # the copies end; only a harvest sees it

        instrument_get(mgr._completions, on_enter)
        out = mgr.wait(jobs, timeout=HANG_S)
        assert all(j.done for j in jobs) and [c.ok for c in out] == [True] * 3
        assert len(log) >= 3 and all(n for _, n in log[:3])
        assert [t for t, n in log if n and t > SLICE_S] == []
        assert mgr.lookup([b"k0", b"k1", b"k2"]) == 3
    finally:
        mgr.close()


def test_with_a_native_mover_the_owner_never_blocks_on_the_queue_while_a_transfer_is_held_or_in_flight():
    """Two stores held together; the owner's own copy of their batch fails (``run_fn``), so the batch is
    started again a transfer at a time in the inter-op threads (``_failed``): the owner waits on those
    copies (``help_one``), never on the completion queue, and both stores end done with their bytes."""
    kv = make_kv(8)
    if not native_available():
        pytest.skip("this torch has no compiled copy")
    made: list[NativeMover] = []
    runs: list[int] = []

    def failing_run(*args: Any) -> Any:
        runs.append(1)
        raise RuntimeError("injected: the owner's copy fails")

    def factory(dev: torch.Tensor, host: torch.Tensor, out: Any) -> NativeMover:
        m = NativeMover([(dev, host)], out, batch_max=64, run_fn=failing_run)
        made.append(m)
        return m

    mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        m = made[0]
        fill_row(kv, 0, b"a")
        fill_row(kv, 1, b"b")
        jobs = [mgr.store(b"a", 0), mgr.store(b"b", 1)]
        log: list[tuple[float, bool]] = []
        instrument_get(mgr._completions, lambda timeout: log.append((timeout, bool(m._held or m._inflight))))
        out = mgr.wait(jobs, timeout=HANG_S)
        assert runs and m.retried == 2
        assert all(j.done for j in jobs) and sorted(c.ok for c in out) == [True, True]
        assert [t for t, busy in log if busy] == []
        assert mgr.lookup([b"a", b"b"]) == 2
        assert row_matches(kv, 0, b"a")
    finally:
        mgr.close()


class _PolledFake(FakeMover):
    """A fake mover whose copies end unseen (``polled``), honest about it: it needs a harvest exactly
    while a transfer it took is unanswered."""

    polled = True

    def needs_harvest(self) -> bool:
        return bool(self.outstanding)


class _StillClock:
    """``manager.time`` for a test: ``monotonic()`` moves only when the test moves ``now``."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


_WAKE_S = manager_mod._WAKE_S
NS = "review-wake|u8|tp0"
ROW = 4096


def test_a_fetch_started_by_a_probe_report_is_sent_before_the_owner_sleeps(redis_url: str, monkeypatch):
    """Machine A publishes a key; machine B (a polled mover, idle) looks it up and ``wait()``s for
    quiescence.  The wait's first pass submits the probe; its answer, applied in an inner pass, starts
    the fetch (``RemoteTier.fetch_found`` -> ``submit_fetch``), which the reader sends only when kicked (or,
    at best, after ``FALLBACK_WAKE_S``).  The owner then blocks on the queue for ``min(timeout, _WAKE_S)``
    with that fetch unsent; before e4e71f1 it slept 0.5 ms and a full pass (``end_step``'s kick) came
    within ``_HELP_SLICE_S``.  The manager's clock stands still except where the owner blocks (each get
    moves it on by its timeout, as if it slept it all), so which pass applies the probe's answer does not
    hang on the machine's timing: the check is whether the owner sleeps longer than a slice with unsent
    work of its own."""
    clock = _StillClock()
    monkeypatch.setattr(manager_mod, "time", clock)

    def cfg(**kw: Any) -> TieredKVConfig:
        return TieredKVConfig(namespace=NS, host_capacity_bytes=16 * ROW, remote_url=redis_url,
                              remote_miss_ttl_seconds=0.0, **kw)

    a = TierManager(cfg(), torch.zeros((8, ROW), dtype=torch.uint8), registry=CollectorRegistry())
    movers: list[_PolledFake] = []

    def factory(d: torch.Tensor, h: torch.Tensor, q: Any) -> _PolledFake:
        movers.append(_PolledFake(d, h, q))
        return movers[-1]

    b = TierManager(cfg(), torch.zeros((8, ROW), dtype=torch.uint8), registry=CollectorRegistry(),
                    mover_factory=factory)
    try:
        k = b"review-wake-key"
        a._device_blocks[0].fill_(7)
        job = a.store(k, 0)
        assert job is not None and a.wait([job], timeout=HANG_S) and job.done
        assert a.flush(timeout=HANG_S)
        store = b._core.remote.store
        kicks, unsent = [0], [0]
        real_kick, real_fetch = store.kick, store.submit_fetch

        def kick() -> None:
            kicks[0] += 1
            unsent[0] = 0
            real_kick()

        def submit_fetch(*args: Any, **kw: Any) -> bool:
            ok = real_fetch(*args, **kw)
            unsent[0] += int(ok)
            return ok

        monkeypatch.setattr(store, "kick", kick)
        monkeypatch.setattr(store, "submit_fetch", submit_fetch)
        gate = threading.Event()
        reads: list[str] = []

        def hold(point: str) -> None:
            if point == "read":
                reads.append(point)
                if len(reads) == 1:     # the probe: answered once the owner blocks in wait()
                    assert gate.wait(HANG_S)

        store.set_test_hook(hold)
        assert b.lookup([k]) == 0       # in no local tier: wanted from the server
        log: list[tuple[float, int, bool]] = []

        def on_enter(timeout: Any) -> None:
            log.append((timeout, unsent[0], movers[0].needs_harvest()))
            clock.now += timeout if timeout is not None else _WAKE_S
            gate.set()

        instrument_get(b._completions, on_enter)
        b.wait(timeout=HANG_S)
        assert b._core.n_in_flight[JobKind.FETCH] == 0 and b.lookup([k]) == 1
        assert len(reads) == 2          # the probe, then the fetch
        slept = [(t, n) for t, n, busy in log if n and t is not None and t > SLICE_S]
        assert slept == [], f"the owner slept {slept} (timeout, fetches unsent) with its fetch waiting for a kick"
    finally:
        b.close()
        a.close()
