"""The remote tier's owner-side steps survive an interrupt anywhere inside them, against a real redis-server.

Each test sweeps one step of the engine thread's: round 29's return hook raises ``KeyboardInterrupt`` at the k-th
call return made from library code inside it, for every k until the call runs through (a report's application is
swept only while ``TierCore.apply`` applies a report of that kind: its frame's ``kind``).  The report is queued
before the swept ``poll()`` (the server answers on its own time: waited for with a deadline, never ordered by
sleeping), so that every run meets the same calls.  Then, with plain calls: every block reaches the server and
comes back from it with its bytes, and at quiescence nothing is left -- no job in flight and the counts agreeing with
the job map, no key asked for, no room held in the reader, no put in flight, every host entry READY and unleased.

* a put's start (``start_puts``: slots pinned before the write is queued; registered if queued, else undone);
* a put's report (``_put_reported`` may run again, ``_put_applied`` once);
* the step's probe (``_start_probe``: registered if the store queued it, else its keys no longer asked for);
* a probe's answer (``RemoteTier.probe_found`` may run again; the fetch it starts is finished or undone:
  ``_fetch_found``/``_fetch_start_broken``);
* a fetch's report (``_fetch_reported`` may run again, ``_fetch_applied`` once).

Before, each of these reports was committed first and applied once, and the starts ran with no handler: an
interrupt inside lost the rest -- host entries leased for good (put), keys asked for for good so that every later
lookup said "ask again later" and never fetched them (probe, probe's answer), room held in the reader for good, host
entries WRITING for good (fetch).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
from prometheus_client import CollectorRegistry

from disk_helpers import fill, keys, make_kv, metric, row_is
from test_interrupt_engine import _engine, _internal_counts_agree, _interrupted, _sweep
from test_interrupt_locks import LIB, _call_with
from test_remote_tier import until as _until
from test_review_round29_sweep import _interrupt_kth
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.index import EntryState
from tiered_kv.core.tiers import TierCore
from tiered_kv.jobs import JobKind

ROW = 4096
N = 4
DEADLINE_S = 15.0


def _manager(url: str, ns: str, seed: int) -> TierManager:
    cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=16 * ROW, remote_url=url, remote_miss_ttl_seconds=0.0)
    return TierManager(cfg, make_kv(16, ROW, seed=seed), registry=CollectorRegistry())


@contextlib.contextmanager
def _two_machines(url: str, ns: str) -> Iterator[tuple[TierManager, TierManager]]:
    """Two managers sharing the server's namespace ``ns`` (the writer and the other machine), closed after."""
    a, b = _manager(url, ns, 1), _manager(url, ns, 2)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _queued(mgr: TierManager, n: int, what: str) -> None:
    """Wait, applying nothing, until ``n`` reports wait in ``mgr``'s completion queue."""
    q = mgr._completions._q
    deadline = time.monotonic() + DEADLINE_S
    while q.qsize() < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: never reported")
        time.sleep(0.001)


def _inside_apply_of(kind: JobKind, k: int) -> tuple[Callable[..., None], list[Any]]:
    """The hook: the k-th call return made from library code while ``TierCore.apply`` applies a report of ``kind``
    (its frame's ``kind``)."""
    code = TierCore.apply.__code__

    def counts(frame: Any, caller: Any) -> bool:
        if not caller.f_code.co_filename.startswith(LIB):
            return False
        f = caller
        while f is not None and f.f_code is not code:
            f = f.f_back
        return f is not None and f.f_locals.get("kind") is kind

    return _interrupt_kth(k, counts)


def _poll_interrupted(mgr: TierManager, kind: JobKind, k: int, what: str) -> tuple[bool, str]:
    hook, fired = _inside_apply_of(kind, k)
    _, exc = _call_with(hook, mgr.poll)
    label = f"{what}: interrupted at {fired[0] if fired else 'no point (ran through)'}"
    assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), f"{label}: raised {exc!r}"
    return bool(fired), label


def _store(mgr: TierManager, ks: list[bytes]) -> None:
    rows = list(range(len(ks)))
    for k, r in zip(ks, rows):
        fill(mgr._device_blocks, r, k)
    job = mgr.store_many(ks, rows)
    assert job is not None
    mgr.wait([job])


def _settled(mgr: TierManager, label: str) -> None:
    """Quiescence: nothing in flight or asked for, no room held, no put in flight, every host entry READY, unleased."""
    core = mgr._core
    remote = core.remote
    _until(lambda: not core.jobs and remote.want_token is None, mgr, f"{label}: quiescence")
    _internal_counts_agree(core, label)
    assert core.n_in_flight[JobKind.FETCH] == 0, f"{label}: {core.n_in_flight[JobKind.FETCH]} fetches in flight"
    assert not remote.asking, f"{label}: keys still asked for: {remote.asking}"
    assert not remote.putting, f"{label}: puts still in flight: {remote.putting}"
    assert remote.store.fetch_room_held == 0, f"{label}: reader room held: {remote.store.fetch_room_held}"
    assert remote.store._r.parts_pending == 0, f"{label}: reader parts pending: {remote.store._r.parts_pending}"
    for e in core.index.entries():
        assert e.state is EntryState.READY and e.readers == 0, f"{label}: {e!r}"


def _served(mgr: TierManager, ks: list[bytes], label: str) -> None:
    """Every key is fetched from the server (looked up until its answers landed) and loads back its bytes."""
    _until(lambda: mgr.lookup(ks) == len(ks), mgr, f"{label}: the keys fetched")
    rows = list(range(8, 8 + len(ks)))
    job = mgr.load_many(ks, rows)
    assert job is not None, label
    done = mgr.wait([job])
    assert all(c.ok for c in done), f"{label}: {done}"
    assert all(row_is(mgr._device_blocks, r, k) for r, k in zip(rows, ks)), f"{label}: wrong bytes"


def test_an_interrupted_put_report_is_applied_again(redis_url: str) -> None:
    def one(k: int) -> bool:
        ks = keys(N, f"put{k}-")
        with _two_machines(redis_url, f"ip{k}") as (a, b):
            _store(a, ks)   # the store's report applied: its put is submitted
            assert a._core.n_in_flight[JobKind.PUT] == 1
            _queued(a, 1, "the put")
            fired, label = _poll_interrupted(a, JobKind.PUT, k, "put report")
            _settled(a, label)
            assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") <= N, label   # (counted once at most)
            _served(b, ks, label)
            _settled(b, label + ", the other machine")
            return fired

    _sweep(one, 10)


def _queued_parts_pinned(mgr: TierManager, label: str) -> None:
    """Every put part the writer holds (queued or being sent) reads a host slot that is pinned: the slot of a live
    entry of its key with a reader, never one free to be reused while the writer still reads it."""
    core = mgr._core
    w = core.remote.store._w
    with w._lock:
        parts = [p for p in list(w._ops) + list(w._inflight) if type(p).__name__ == "PutPart"]
    for p in parts:
        e = core.index.get(p.key)
        assert e is not None and e.readers > 0, f"{label}: the write of {p.key!r} reads a slot not pinned: {e!r}"


def test_an_interrupted_put_start_is_finished_or_undone(redis_url: str) -> None:
    """A store's report applied by ``wait()`` starts its write-through put: an interrupt at every call return inside
    ``TierCore.start_puts`` leaves it registered (the store queued it: its slots were pinned first) or undone (each
    pin released); the writer never holds a write whose slot is not pinned.  Then nothing is left pinned or in
    flight, and every key the server got is served with its bytes.  Before, the slots were pinned after the write
    was queued and the job registered after that: an interrupt between left a queued write reading a slot that
    eviction could hand to another key (the server would have stored that key's bytes under this one), or slots
    pinned for good."""
    def one(k: int) -> bool:
        ks = keys(N, f"ps{k}-")
        with _two_machines(redis_url, f"ips{k}") as (a, b):
            rows = list(range(N))
            for key_, r in zip(ks, rows):
                fill(a._device_blocks, r, key_)
            job = a.store_many(ks, rows)
            assert job is not None
            fired, label = _interrupted(TierCore.start_puts, k, lambda: a.wait([job], timeout=1.0), "put start")
            _internal_counts_agree(a._core, label)
            _queued_parts_pinned(a, label)
            a.wait([job], timeout=1.0)
            assert a.flush(timeout=DEADLINE_S), label
            _settled(a, label)
            n = b.lookup(ks)   # the keys the server got (all of them, unless the start was undone)
            _until(lambda: not b._core.jobs and b._core.remote.want_token is None, b, f"{label}: b's probe")
            n = b.lookup(ks)
            if fired:
                assert n in (0, N), f"{label}: {n} of {N} keys on the server (one put job: all or none)"
            else:
                assert n == N, f"{label}: {n} of {N} keys on the server"
            if n:
                _served(b, ks, label)
            _settled(b, label + ", the other machine")
            return fired

    _sweep(one, 10)


def _stored_elsewhere(url: str, ns: str, ks: list[bytes]) -> None:
    a = _manager(url, ns, 1)
    try:
        _store(a, ks)
        assert a.flush(timeout=DEADLINE_S)
        assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") == len(ks)
    finally:
        a.close()


def test_an_interrupted_probe_start_is_finished_or_undone(redis_url: str) -> None:
    def one(k: int) -> bool:
        ks = keys(N, f"probe{k}-")
        _stored_elsewhere(redis_url, f"is{k}", ks)
        b = _manager(redis_url, f"is{k}", 2)
        try:
            assert b.lookup(ks) == 0   # asked for: the poll's end of step submits the probe
            fired, label = _interrupted(TierCore._start_probe, k, b.poll, "probe start")
            _internal_counts_agree(b._core, label)
            _served(b, ks, label)
            _settled(b, label)
            return fired
        finally:
            b.close()

    _sweep(one, 10)


@pytest.mark.parametrize("report", ["probe", "fetch"])
def test_an_interrupted_probe_or_fetch_report_is_applied_again(redis_url: str, report: str) -> None:
    def one(k: int) -> bool:
        ks = keys(N, f"{report}{k}-")
        _stored_elsewhere(redis_url, f"if{report}{k}", ks)
        b = _manager(redis_url, f"if{report}{k}", 2)
        core = b._core
        try:
            assert b.lookup(ks) == 0
            b.poll()   # the probe submitted
            assert core.n_in_flight[JobKind.FETCH] == 1
            _queued(b, 1, "the probe")
            if report == "fetch":
                b.poll()   # the probe's answer applied: the fetch submitted
                fetch = [j for j in core.jobs.values() if j.kind is JobKind.FETCH]
                assert len(fetch) == 1 and len(fetch[0]._entries) == N, fetch
                _queued(b, 1, "the fetch")
            fired, label = _poll_interrupted(b, JobKind.FETCH, k, f"{report} report")
            _internal_counts_agree(core, label)
            _served(b, ks, label)
            _settled(b, label)
            return fired
        finally:
            b.close()

    _sweep(one, 10)


def test_a_seeded_engine_every_call_interrupted_remote_tier(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_interrupt_engine``'s seeded engine (every call interrupted once at a random call return, then made
    again) with a remote tier and ``lookup`` among its calls: the host tier's 12 slots evict, a lookup of an
    evicted key probes the server and fetches it, invalidations tomb it there.  Then nothing is left in flight,
    asked for, pinned or held in the reader (``_settled``), and the host-tier checks hold: every job the caller
    holds reported exactly once, every ready key loads back the bytes its store copied."""
    import tiered_kv.manager

    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", 0.5)

    def settle(w: Any, label: str) -> None:
        m = w.mgr
        core = m._core
        assert m.flush(timeout=DEADLINE_S), label
        deadline = time.monotonic() + DEADLINE_S
        while core.jobs or core.remote.want_token is not None:   # (the server answers on its own time)
            assert time.monotonic() < deadline, f"{label}: never quiescent: {list(core.jobs.values())[:3]}"
            w.take(m.wait(timeout=0.01))
        _settled(m, label)

    for seed in range(20):
        _engine(seed, None, redis_url, settle)
