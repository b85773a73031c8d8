"""What an engine thread blocked in ``wait()`` pays per wake-up, checked by what it does, not by a timing.

A lone load from disk (``load()`` then ``wait([job])``) waits for two reports: the read's and the row
copy's.  Three costs were found in that wait (``benchmarks/`` figures in docs/benchmarks.md):

* every timed slice of ``get_within`` restored the signal mask through ``signal.pthread_sigmask``, whose
  wrapper turns each signal of the mask it returns into a ``Signals`` enum member: about 200 us per
  wake-up on the reference VM, held with the GIL between the report's arrival and its application;
* the wait's first pass published every counter and gauge, which its last pass publishes again;
* with a polled mover (``NativeMover``, the CPU default) the owner woke every 0.5 ms to harvest copies
  even with none in flight, taking the GIL from a disk reader verifying a block.
"""

from __future__ import annotations

import queue
import signal
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from fakes import FakeMover, fake_disk_manager, fill_row, instrument_get, make_config, make_kv
from tiered_kv import TierManager
from tiered_kv import manager as manager_mod
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CudaMover, NativeMover, native_available, native_fits
from tiered_kv.movers.base import Transfer
from tiered_kv.reports import CompletionQueue, get_within


def test_a_timed_wait_turns_no_signal_of_the_mask_into_an_enum_member(monkeypatch):
    """Each slice of a timed wait holds the asynchronous signals off and restores the mask after.  The
    restore must not go through ``signal.pthread_sigmask``'s enum conversion (``signal._int_to_enum``
    for every signal of the old mask: most of a report's wake-up)."""
    converted = []
    real = signal._int_to_enum   # type: ignore[attr-defined]

    def counting(value, klass):
        converted.append(value)
        return real(value, klass)

    monkeypatch.setattr(signal, "_int_to_enum", counting)
    q: "queue.SimpleQueue[str]" = queue.SimpleQueue()
    with pytest.raises(queue.Empty):
        get_within(q, 0.001)           # one slice on an empty queue, then its timeout
    threading.Timer(0.01, q.put, ("report",)).start()
    assert get_within(q, 30) == "report"   # slices until the put lands
    assert converted == []
    # and the mask is this thread's again afterwards: nothing left held off
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class _Counted:
    """Counts the core's publications of counters and gauges."""

    def __init__(self, mgr: TierManager, monkeypatch) -> None:
        self.n = 0
        core = mgr._core
        real = core.refresh_gauges

        def refresh() -> None:
            self.n += 1
            real()

        monkeypatch.setattr(core, "refresh_gauges", refresh)


def test_a_wait_whose_job_is_answered_at_once_publishes_the_gauges_once(monkeypatch):
    """A wait whose job's report is already queued ends in its first pass: the counters and gauges are
    published once, by the last pass (and exact on return), not by the first pass as well."""
    kv = make_kv(4)
    movers: list[FakeMover] = []

    def factory(d, h, q):
        movers.append(FakeMover(d, h, q))
        return movers[-1]

    mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        fill_row(kv, 0, b"k")
        job = mgr.store(b"k", 0)
        movers[0].complete_all()        # its report waits in the queue before wait() starts
        counted = _Counted(mgr, monkeypatch)
        out = mgr.wait([job], timeout=30)
        assert [c.ok for c in out] == [True]
        assert counted.n == 1
        assert mgr.metrics.blocks["host"]._value.get() == 1   # published by that one pass
    finally:
        mgr.close()


def test_a_wait_that_lasts_still_publishes_in_its_inner_passes(monkeypatch):
    """The first pass leaves the gauges to the last one, but a wait that lasts publishes them in its
    periodic full passes (here every pass: ``_HELP_SLICE_S`` = 0), so a scrape during a long wait sees
    them move."""
    monkeypatch.setattr(manager_mod, "_HELP_SLICE_S", 0.0)
    kv = make_kv(4)
    movers: list[FakeMover] = []

    def factory(d, h, q):
        movers.append(FakeMover(d, h, q))
        return movers[-1]

    mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        fill_row(kv, 0, b"k")
        job = mgr.store(b"k", 0)
        counted = _Counted(mgr, monkeypatch)
        gets = []

        def on_enter(timeout):
            gets.append(timeout)
            if len(gets) == 3:
                movers[0].complete_all()

        instrument_get(mgr._completions, on_enter)
        assert [c.ok for c in mgr.wait([job], timeout=30)] == [True]
        assert counted.n >= 3   # the passes between the gets, and the last
    finally:
        mgr.close()


class _Polled(FakeMover):
    """A fake mover whose copies end unseen (``polled``): ``busy`` says whether one is in flight."""

    polled = True

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.busy = False

    def needs_harvest(self) -> bool:
        return self.busy


@pytest.mark.parametrize("busy", [False, True])
def test_a_blocked_owner_wakes_each_slice_only_while_a_polled_mover_has_copies_in_flight(busy):
    """The owner blocks on the completion queue: in slices of 0.5 ms while a polled mover has a copy in
    flight (only its harvest() sees that copy end: a CUDA mover's), otherwise until a report comes (at
    most ``_WAKE_S``): a slice then only woke the owner to take the GIL from a disk reader."""
    kv = make_kv(4)
    movers: list[_Polled] = []

    def factory(d, h, q):
        movers.append(_Polled(d, h, q))
        return movers[-1]

    mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        movers[0].busy = busy
        fill_row(kv, 0, b"k")
        job = mgr.store(b"k", 0)
        gets = []

        def on_enter(timeout):
            gets.append(timeout)
            movers[0].complete_all()

        instrument_get(mgr._completions, on_enter)
        assert [c.ok for c in mgr.wait([job], timeout=30)] == [True]
        assert len(gets) == 1
        if busy:
            assert gets[0] <= 0.0005
        else:
            assert gets[0] == pytest.approx(min(30, manager_mod._WAKE_S), rel=0.1)
    finally:
        mgr.close()


def test_the_native_mover_needs_a_harvest_only_while_a_transfer_is_held_or_in_flight():
    """``NativeMover.needs_harvest``: False idle; True while a submitted transfer is held or copying;
    False again once its report was harvested."""
    dev = torch.zeros(4, 64, dtype=torch.uint8)
    host = torch.arange(4 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 64)
    if not (native_available() and native_fits([(dev, host)])):
        pytest.skip("this torch has no compiled copy for these rows")
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q)
    try:
        assert not m.needs_harvest()
        m.hold(True)
        m.submit(Transfer(1, JobKind.LOAD, [0], [1]))
        assert m.needs_harvest()          # held
        m.hold(False)                     # started in the inter-op threads
        while q.get(0.05) is None:
            m.harvest()
        assert not m.needs_harvest()
        assert torch.equal(dev[0], host[1])
    finally:
        m.close()


def test_the_cuda_mover_needs_a_harvest_while_a_copy_is_queued_or_on_the_device():
    """``CudaMover.needs_harvest`` (simulated device): True from submit until the harvest that answers the
    copy -- queued, then on the device, then done but not yet seen -- and False after it."""
    gpu, out = FakeGPU(), CompletionQueue()
    dev = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8)
    host = torch.zeros((4, 8), dtype=torch.uint8)
    m = CudaMover([(dev, host)], out, 1, runtime=gpu, batch_max=8)
    try:
        assert not m.needs_harvest()
        m.submit(Transfer(1, JobKind.STORE, [2], [0]))
        assert m.needs_harvest()          # queued
        m.flush()
        assert m.needs_harvest()          # on the device
        gpu.run_all()
        assert m.needs_harvest()          # ended, unseen until harvest()
        m.harvest()
        assert not m.needs_harvest()
        assert out.get(0) is not None and torch.equal(host[0], dev[2])
    finally:
        m.close()


@pytest.mark.disk_threads
@pytest.mark.parametrize("backlogged", [False, True])
def test_a_blocked_owner_wakes_each_slice_while_the_disk_store_holds_ops_back(tmp_path, backlogged):
    """With an idle mover the owner sleeps until a report comes, unless the disk store holds ops back (the
    disk I/O process's pipe was full: ``TierCore.unsent``): then it wakes each 0.5 ms slice, and each
    wake-up's pass sends more of them."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        mgr.disk.backlogged = backlogged   # the thread-mode store's class attribute, shadowed here
        fill_row(kv, 0, b"k")
        job = mgr.store(b"k", 0)
        gets = []

        def on_enter(timeout):
            gets.append(timeout)
            mover.complete_all()

        instrument_get(mgr._completions, on_enter)
        assert [c.ok for c in mgr.wait([job], timeout=30)] == [True]
        assert len(gets) == 1
        if backlogged:
            assert gets[0] <= manager_mod._POLL_SLICE_S
        else:
            assert gets[0] == pytest.approx(manager_mod._WAKE_S, rel=0.1)
    finally:
        mgr.disk.backlogged = False
        mgr.close()
