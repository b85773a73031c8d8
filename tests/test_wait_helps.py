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
        movers.append(ThreadMover(dev, host, q, num_workers=1, copy_fn=gate))
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
