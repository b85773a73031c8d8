"""wait() runs copies still queued for the ThreadMover's workers on the owner thread (ThreadMover.help_one).

The copy workers are held at a gate inside the injected copy function, so the
tests decide which thread makes which copy: a worker that entered the gate
holds its transfer, and every transfer still queued can only be run by the
owner, inside wait().
"""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import make_config
from tiered_kv import TierManager
from tiered_kv.jobs import StaleReason
from tiered_kv.movers import ThreadMover

ROWS, ROW = 8, 256


class GatedCopies:
    """copy_fn for ThreadMover: records (thread name, dst) per copy; copies made by worker threads wait
    at a gate until ``release()``; the owner's copies raise ``owner_raises`` once if it is set."""

    def __init__(self) -> None:
        self.copies: list[str] = []
        self.worker_in = threading.Event()
        self._go = threading.Event()
        self.owner_raises: BaseException | None = None

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        name = threading.current_thread().name
        if name.startswith("tiered-kv-copy"):
            self.worker_in.set()
            assert self._go.wait(30), "the test never released the copy workers"
        elif self.owner_raises is not None:
            exc, self.owner_raises = self.owner_raises, None
            raise exc
        dst.copy_(src)
        self.copies.append(name)

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def rig():
    kv = torch.stack([torch.full((ROW,), i + 1, dtype=torch.uint8) for i in range(ROWS)])
    gate = GatedCopies()
    movers: list[ThreadMover] = []

    def factory(dev, host, q):
        movers.append(ThreadMover([(dev, host)], q, num_workers=1, copy_fn=gate))
        return movers[-1]

    mgr = TierManager(make_config(16, row_bytes=ROW), kv, registry=CollectorRegistry(), mover_factory=factory)
    yield kv, mgr, gate, movers[0]
    gate.release()
    mgr.close()


def _stores(mgr: TierManager, n: int, gate: GatedCopies) -> list:
    """n stores; the one worker holds the first at the gate, the others stay queued."""
    jobs = [mgr.store(b"k%d" % i, i) for i in range(n)]
    assert all(j is not None for j in jobs)
    assert gate.worker_in.wait(30)
    return jobs


def test_wait_runs_the_queued_copies_on_the_owner_thread_while_the_workers_are_busy(rig):
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 6, gate)
    done = mgr.wait(jobs[1:], timeout=30)      # job 0 is held by the worker: only the owner can copy the rest
    assert sorted(c.job.key for c in done) == [b"k%d" % i for i in range(1, 6)] and all(c.ok for c in done)
    assert gate.copies == [threading.current_thread().name] * 5 and mover.helped == 5
    for i in range(1, 6):
        assert torch.equal(mgr.host_bytes(b"k%d" % i), kv[i])
    assert not jobs[0].done
    gate.release()
    done = mgr.wait(timeout=30)
    assert [c.job for c in done] == [jobs[0]] and done[0].ok
    assert mgr.lookup([b"k%d" % i for i in range(6)]) == 6
    assert mgr.debug_sizes()["jobs"] == 0


def test_an_exception_escaping_a_copy_in_wait_still_answers_its_transfer_exactly_once(rig):
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 3, gate)
    gate.owner_raises = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        mgr.wait(jobs[1:], timeout=30)         # the owner takes job 1's copy, which raises
    reported = mgr.poll()
    assert [(c.job, c.ok) for c in reported] == [(jobs[1], False)]
    assert "copy interrupted" in reported[0].error and "KeyboardInterrupt" in reported[0].error
    assert mgr.lookup([b"k1"]) == 0 and mgr.host_bytes(b"k1") is None
    gate.release()
    rest = mgr.wait(timeout=30)                # job 2 (by whoever takes it) and job 0 (the worker)
    assert sorted(c.job.key for c in rest) == [b"k0", b"k2"] and all(c.ok for c in rest)
    assert mgr.poll() == [] and mgr.debug_sizes()["jobs"] == 0
    assert mgr.store(b"k1", 1) is not None     # the key can be stored again; its slot was not leaked
    assert [c.ok for c in mgr.wait(timeout=30)] == [True]


def test_a_cancelled_store_taken_by_the_owner_is_answered_without_a_copy(rig):
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 3, gate)
    mgr.cancel(jobs[1])
    done = mgr.wait(jobs[1:], timeout=30)
    assert {(c.job.key, c.ok) for c in done} == {(b"k1", False), (b"k2", True)}
    assert gate.copies == [threading.current_thread().name]   # job 2's copy only
    assert mover.helped == 2                                  # both taken off the queue by the owner


def test_a_wait_that_has_timed_out_runs_no_copy(rig):
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 4, gate)
    assert mgr.wait(jobs[1:], timeout=0) == [] and mover.helped == 0
    assert gate.copies == []


def test_wait_for_one_job_stops_copying_for_others_within_a_slice(rig, monkeypatch):
    """The owner copies in slices of 2 ms and then checks its targets: waiting for one job does not
    first run every copy queued behind it.  A fake clock advances 1 ms per copy the owner makes."""
    import tiered_kv.manager as manager_mod
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 8, gate)                       # the worker holds job 0; 1..7 are queued
    clock = [1000.0]
    monkeypatch.setattr(manager_mod.time, "monotonic", lambda: clock[0])
    copy = mover._copy

    def copy_and_tick(dst, src):
        copy(dst, src)
        if not threading.current_thread().name.startswith("tiered-kv-copy"):
            clock[0] += 0.001
    mover._copy = copy_and_tick
    done = mgr.wait([jobs[1]], timeout=30)
    assert jobs[1].done and jobs[1] in [c.job for c in done]
    assert mover.helped == 2, f"the owner ran {mover.helped} copies to get one job done"
    assert sum(j.done for j in jobs) == 2              # jobs 1 and 2; 3..7 still queued


class _InterruptingQueue:
    """The completion queue, whose next ``put`` from the owner thread raises KeyboardInterrupt, as a
    signal handler does at the eval-breaker check around a call: ``before`` the report is queued, or
    ``after`` (the call returned, the handler runs before the next bytecode)."""

    def __init__(self, q, when: str) -> None:
        self.q, self.when, self.armed = q, when, True

    def put(self, item) -> None:
        fire = self.armed and not threading.current_thread().name.startswith("tiered-kv-copy")
        if fire:
            self.armed = False
            if self.when == "before":
                raise KeyboardInterrupt
        self.q.put(item)
        if fire:
            raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.q, name)


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_at_the_report_of_an_owner_copy_answers_it_exactly_once(rig, when):
    """help_one() answers for a transfer from the moment it is bound until its report is queued: an
    interrupt just before the put reports the job failed; one just after it queues a second, failed
    report that finds no live token (counted unknown_token) -- either way the job is reported once."""
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 2, gate)              # the worker holds job 0; job 1 can only be copied by the owner
    mover._out = _InterruptingQueue(mover._out, when)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait([jobs[1]], timeout=30)
    out = mgr.poll()
    assert [c.job for c in out] == [jobs[1]]
    assert out[0].ok is (when == "after")
    stale = mgr.metrics.stale[(jobs[1].kind, StaleReason.UNKNOWN_TOKEN)]._value.get()
    assert stale == (1 if when == "after" else 0)
    assert (mgr.host_bytes(b"k1") is not None) is (when == "after")
    gate.release()
    assert [c.job for c in mgr.wait(timeout=30)] == [jobs[0]]
    assert mgr.poll() == [] and mgr.debug_sizes()["jobs"] == 0


def test_an_interrupt_before_a_held_transfer_leaves_the_queue_answers_it_and_no_worker_copies_it(rig):
    """Interrupted between binding the transfer and taking it off the owner's queue: it is taken off
    (else a later flush would hand it to a worker, whose copy could land after the job was reported)
    and answered failed, once."""
    import collections
    kv, mgr, gate, mover = rig
    jobs = _stores(mgr, 1, gate)              # the worker holds job 0

    class InterruptedPop(collections.deque):
        armed = True

        def popleft(self):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return super().popleft()

    mover.hold(True)
    mover._held = InterruptedPop()
    job = mgr.store(b"k1", 1)                 # held for the owner
    assert job is not None and len(mover._held) == 1
    with pytest.raises(KeyboardInterrupt):
        mover.help_one()
    mover.hold(False)
    assert len(mover._held) == 0
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, False)] and "copy interrupted" in out[0].error
    gate.release()
    assert [c.job for c in mgr.wait(timeout=30)] == [jobs[0]]
    assert gate.copies.count(threading.current_thread().name) == 0 and len(gate.copies) == 1


def test_help_one_leaves_a_workers_stop_sentinel_in_the_queue():
    host = torch.zeros((2, ROW), dtype=torch.uint8)
    from tiered_kv.movers import CompletionQueue
    mover = ThreadMover([(torch.zeros((2, ROW), dtype=torch.uint8), host)], CompletionQueue(), num_workers=0)
    assert mover.help_one() is False          # empty
    mover._q.put(None)
    assert mover.help_one() is False and mover._q.qsize() == 1 and mover._q.get_nowait() is None
    assert len(mover._held) == 0
