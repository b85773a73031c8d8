"""The remote tier through the core and its front ends, against real redis-server processes.

Two managers in one process stand for two serving machines sharing one server (the two-process
and cluster runs are in tests/test_remote_two_machines.py).  Every wait polls with a deadline;
nothing is ordered by sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from disk_helpers import content, fill, keys, make_kv, metric, row_is
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind, StaleReason

ROW = 4096
NS = "remote-test|u8|tp0"
DEADLINE_S = 15.0


def remote_config(url: str, *, host_slots: int = 32, namespace: str = NS, **kw: Any) -> TieredKVConfig:
    kw.setdefault("remote_miss_ttl_seconds", 0.0)   # ask again at once: the tests look up until a hit
    return TieredKVConfig(namespace=namespace, host_capacity_bytes=host_slots * ROW, remote_url=url, **kw)


@pytest.fixture
def managers() -> Iterator[Callable[..., TierManager]]:
    made: list[TierManager] = []

    def make(cfg: TieredKVConfig, rows: int = 16) -> TierManager:
        m = TierManager(cfg, make_kv(rows, ROW, seed=len(made) + 1), registry=CollectorRegistry())
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def store_all(mgr: TierManager, ks: list[bytes], first_row: int = 0) -> None:
    rows = list(range(first_row, first_row + len(ks)))
    for k, r in zip(ks, rows):
        fill(mgr._device_blocks, r, k)
    job = mgr.store_many(ks, rows)
    assert job is not None
    mgr.wait([job])
    for r in rows:
        mgr.free_block(r)


def until(cond: Callable[[], bool], mgr: TierManager, what: str) -> None:
    """Poll ``mgr`` until ``cond()``; fail after the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        mgr.poll()
        time.sleep(0.002)   # not ordering anything: the server answers on its own time


def fetched(mgr: TierManager, ks: list[bytes]) -> int:
    """Look ``ks`` up until the server's answers landed; how many leading keys are then held."""
    n = mgr.lookup(ks)
    until(lambda: mgr._core.n_in_flight[JobKind.FETCH] == 0 and mgr._core.remote.want_token is None, mgr,
          "the probe and the fetch")
    return max(n, mgr.lookup(ks))


def load_equal(mgr: TierManager, ks: list[bytes], first_row: int = 8) -> bool:
    rows = list(range(first_row, first_row + len(ks)))
    job = mgr.load_many(ks, rows)
    if job is None:
        return False
    done = mgr.wait([job])
    return all(c.ok for c in done) and all(row_is(mgr._device_blocks, r, k) for r, k in zip(rows, ks))


# --------------------------------------------------------------------------- sharing
def test_a_block_stored_by_one_manager_is_served_to_another(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    ks = keys(6, "share")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") == 6
    assert metric(a, "tiered_kv_transfer_bytes_total", src="host", dst="remote") == 6 * ROW
    assert b.lookup(ks) == 0            # not local: asked from the server, never waited for
    assert fetched(b, ks) == 6
    assert load_equal(b, ks)
    assert metric(b, "tiered_kv_lookup_hits_total", tier="remote") == 6
    assert metric(b, "tiered_kv_transfer_bytes_total", src="remote", dst="host") == 6 * ROW


def test_namespaces_never_cross(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url, namespace="model-a|u8"))
    b = managers(remote_config(redis_url, namespace="model-b|u8"))
    ks = keys(3, "ns")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    assert fetched(b, ks) == 0
    assert metric(b, "tiered_kv_lookup_hits_total", tier="remote") == 0


def test_a_prefix_is_fetched_only_up_to_the_first_key_the_server_lacks(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url, remote_miss_ttl_seconds=60.0))
    ks = keys(5, "pre")
    store_all(a, [ks[0], ks[1], ks[3]])
    assert a.flush(timeout=DEADLINE_S)
    assert fetched(b, ks) == 2
    # ks[2] was missed lately: the next lookup does not ask again, so ks[3] stays on the server
    assert b.lookup(ks) == 2
    b.poll()
    assert b._core.n_in_flight[JobKind.FETCH] == 0 and b._core.remote.want_token is None


# --------------------------------------------------------------------------- invalidation across machines
def test_invalidate_on_one_manager_removes_the_value_another_wrote(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    ks = keys(2, "inv")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    b.invalidate(ks[0])
    b.flush(timeout=DEADLINE_S)
    c = managers(remote_config(redis_url))
    assert fetched(c, [ks[1]]) == 1
    until(lambda: c.lookup([ks[0]]) == 0 and c._core.n_in_flight[JobKind.FETCH] == 0, c, "the miss")
    assert fetched(c, [ks[0]]) == 0


def test_a_write_arriving_after_an_invalidate_elsewhere_is_refused(redis_url: str, managers: Any) -> None:
    """The tombstone B's invalidate left refuses A's write of the key while it lives (A's write is
    'late': it reaches the server after the invalidate)."""
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    k = b"late-key"
    b.invalidate(k)
    b.flush(timeout=DEADLINE_S)
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)   # a refused write is no fault
    assert metric(a, "tiered_kv_remote_refused_writes_total", reason="tomb") == 1
    assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="cancelled") == 1
    assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") == 0
    assert fetched(managers(remote_config(redis_url)), [k]) == 0


def test_invalidating_a_key_whose_write_is_in_flight_discards_that_part(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url))
    ks = keys(3, "part")
    for i, k in enumerate(ks):
        fill(a._device_blocks, i, k)
    job = a.store_many(ks, [0, 1, 2])
    a.wait([job])        # published: the put job is submitted, its report not yet applied
    put = next(j for j in a._core.jobs.values() if j.kind is JobKind.PUT)
    a.invalidate(ks[1])  # before any report of the put is applied
    assert a.flush(timeout=DEADLINE_S)
    assert put._dead == {1: StaleReason.SUPERSEDED}
    assert metric(a, "tiered_kv_stale_callbacks_total", kind="put", reason="superseded") == 1
    assert metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") == 2
    b = managers(remote_config(redis_url))
    assert fetched(b, [ks[0]]) == 1 and fetched(b, [ks[2]]) == 1
    assert fetched(b, [ks[1]]) == 0
    assert not a._core.remote.putting


def test_a_fetched_key_invalidated_before_its_answer_is_applied_is_not_published(redis_url: str,
                                                                               managers: Any) -> None:
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    ks = keys(2, "fx")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    assert b.lookup(ks) == 0
    assert b._core.index.used_slots == 0   # asked (a probe), nothing reserved until the server answers

    def fetching() -> list[Any]:
        return [j for j in b._core.jobs.values() if j.kind is JobKind.FETCH and j._entries]

    until(lambda: bool(fetching()), b, "the probe's answer and the fetch it starts")
    fetch = fetching()[0]
    assert b._core.index.used_slots == 2
    b.invalidate(ks[0])            # the fetch's answer is applied at a later poll, after this
    until(lambda: fetch.token.int not in b._core.jobs, b, "the fetch's report")
    assert b._core.index.get(ks[0]) is None
    assert b._core.index.ready(ks[1]) is not None
    assert metric(b, "tiered_kv_stale_callbacks_total", kind="fetch", reason="superseded") == 1
    assert b._core.index.used_slots == 1   # the dropped part's slot is free again


def test_a_key_wanted_and_dropped_in_the_same_step_is_not_fetched(redis_url: str, managers: Any) -> None:
    b = managers(remote_config(redis_url))
    k = b"dropped-early"
    assert b.lookup([k]) == 0
    assert b._core.remote.want_keys == [k]
    b.invalidate(k)
    b.poll()
    assert b._core.n_in_flight[JobKind.FETCH] == 0
    assert not b._core.remote.asking


def test_a_miss_costs_no_host_slot_and_evicts_nothing(redis_url: str, managers: Any) -> None:
    """A lookup of keys the server lacks (a new prompt) must not evict the blocks the host holds."""
    b = managers(remote_config(redis_url, host_slots=8, host_evict_ahead_blocks=0, remote_miss_ttl_seconds=60.0))
    held = keys(8, "held")
    store_all(b, held)
    assert b._core.index.used_slots == 8        # full
    new = keys(6, "new-prompt")
    assert fetched(b, new) == 0
    assert b.lookup(held) == 8                  # nothing evicted
    assert metric(b, "tiered_kv_evictions_total", tier="host") == 0


def test_a_block_the_engine_stores_while_it_is_fetched_is_stored(redis_url: str, managers: Any) -> None:
    """The engine computed the block: its store wins over the fetch in flight (whose part is discarded)."""
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    ks = keys(2, "race")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    b.lookup(ks)
    until(lambda: any(j.kind is JobKind.FETCH and j._entries for j in b._core.jobs.values()), b, "the fetch")
    store_all(b, [ks[0]])                       # before the fetch's answer is applied
    assert metric(b, "tiered_kv_jobs_total", kind="store", outcome="ok") == 1
    until(lambda: b._core.n_in_flight[JobKind.FETCH] == 0, b, "the fetch's answer")
    assert metric(b, "tiered_kv_stale_callbacks_total", kind="fetch", reason="superseded") == 1
    assert b.lookup(ks) == 2 and load_equal(b, ks)


def test_a_superseded_fetchs_slot_is_not_reused_before_its_bytes_land(redis_url: str, managers: Any) -> None:
    """A fetch reads each payload straight into its reserved host slot.  Hold the fetch's GETs, let the
    engine store the key itself (the fetch's part is superseded) and then fill the host tier with other
    keys: the superseded part's slot stays leased to the fetch, so when its bytes land they overwrite no
    other key's block."""
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url, host_slots=4, host_evict_ahead_blocks=0))
    ks = keys(2, "lease")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    gate, reads = threading.Event(), []

    def hold(point: str) -> None:
        if point == "read":
            reads.append(point)
            if len(reads) == 2:          # the first read is the probe (EXISTS), the second the fetch (GET)
                assert gate.wait(DEADLINE_S)
    b._core.remote.store.set_test_hook(hold)
    b.lookup(ks)
    until(lambda: len(reads) == 2, b, "the fetch held before its GETs")
    store_all(b, [ks[0]])                        # superseded: the engine's own block, in another slot
    assert b.flush(timeout=DEADLINE_S)           # its remote write answered: its slot is evictable again
    others = keys(3, "fill")
    for k in others:                             # the two fetch slots are leased: these evict each other
        store_all(b, [k])
        assert b.flush(timeout=DEADLINE_S)
    gate.set()
    until(lambda: b._core.n_in_flight[JobKind.FETCH] == 0, b, "the fetch's answer")
    held = [k for k in [ks[0], *others] if b.lookup([k]) == 1]
    assert others[-1] in held and load_equal(b, held), "a block was overwritten by a fetch's bytes"
    assert metric(b, "tiered_kv_stale_callbacks_total", kind="fetch", reason="superseded") == 1


def test_a_key_stored_while_it_is_probed_is_not_fetched(redis_url: str, managers: Any) -> None:
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    k = b"probed"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    b.lookup([k])
    store_all(b, [k])                           # the probe went with that wait's first pass; its answer is later
    until(lambda: b._core.n_in_flight[JobKind.FETCH] == 0, b, "the probe's answer")
    assert not any(j.kind is JobKind.FETCH for j in b._core.jobs.values())
    assert metric(b, "tiered_kv_transfer_bytes_total", src="remote", dst="host") == 0
    assert load_equal(b, [k])


# --------------------------------------------------------------------------- integrity
def test_a_corrupt_value_on_the_server_is_a_miss_and_counted(redis_url: str, managers: Any,
                                                             redis_server: Any) -> None:
    a = managers(remote_config(redis_url))
    k = b"to-corrupt"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    client = redis_server.client()
    names = [n for n in client.keys("tkv:*") if n.endswith(b":v")]
    assert len(names) == 1
    value = bytearray(client.get(names[0]))
    value[-1] ^= 0xFF                 # one payload byte flipped: the checksum no longer matches
    client.set(names[0], bytes(value))
    b = managers(remote_config(redis_url, remote_miss_ttl_seconds=60.0))
    assert fetched(b, [k]) == 0
    assert b._core.remote.want_keys == []   # remembered as a miss: the last lookup did not ask again
    assert metric(b, "tiered_kv_remote_corrupt_values_total", reason="checksum") == 1
    assert b._core.index.get(k) is None
    until(lambda: client.get(names[0]) is None, b, "the bad value deleted (it had not changed)")


# --------------------------------------------------------------------------- faults
def test_a_server_down_at_start_degrades_to_misses_and_recovers(fresh_redis: Any, managers: Any) -> None:
    fresh_redis.stop()
    a = managers(remote_config(fresh_redis.url, remote_timeout_seconds=0.2, remote_write_deadline_seconds=1.0,
                               remote_tomb_ttl_seconds=5))
    ks = keys(4, "down")
    store_all(a, ks)                       # host tier works; the remote writes are shed or fail, counted
    assert a.lookup(ks) == 4
    a.poll()
    until(lambda: metric(a, "tiered_kv_healthy", tier="remote") == 0, a, "the remote tier marked down")
    shed = metric(a, "tiered_kv_shed_total", kind="put", reason="remote_down")
    failed = metric(a, "tiered_kv_jobs_total", kind="put", outcome="failed")
    assert shed + failed == 4
    fresh_redis.start()
    until(lambda: metric(a, "tiered_kv_healthy", tier="remote") == 1, a, "the remote tier back")
    more = keys(2, "up")
    store_all(a, more, first_row=4)
    assert a.flush(timeout=DEADLINE_S)
    b = managers(remote_config(fresh_redis.url))
    assert fetched(b, more) == 2 and load_equal(b, more)


def test_no_remote_call_raises_into_the_engine_when_the_server_dies_mid_run(fresh_redis: Any,
                                                                            managers: Any) -> None:
    a = managers(remote_config(fresh_redis.url, remote_timeout_seconds=0.2, remote_write_deadline_seconds=1.0,
                               remote_tomb_ttl_seconds=5))
    ks = keys(8, "mid")
    store_all(a, ks[:4])
    assert a.flush(timeout=DEADLINE_S)
    fresh_redis.stop()
    store_all(a, ks[4:], first_row=4)
    a.lookup(keys(4, "absent"))
    a.invalidate(ks[0])
    a.flush(timeout=DEADLINE_S)            # may answer False (failed writes), never raises
    until(lambda: metric(a, "tiered_kv_healthy", tier="remote") == 0, a, "the remote tier marked down")
    assert a.lookup(ks[1:4]) == 3          # the host tier still serves
    assert load_equal(a, ks[1:4])


# --------------------------------------------------------------------------- the vLLM scheduler side
def test_the_scheduler_answers_retry_while_the_server_is_asked_then_hit(redis_url: str, managers: Any,
                                                                        tmp_path: Any) -> None:
    from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
    from tiered_kv.integrations.slab import SharedSlab
    from tiered_kv.metrics import Metrics

    a = managers(remote_config(redis_url))
    ks = keys(3, "sched")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    slab = SharedSlab.open(tmp_path / "s.slab", 8, ROW, 1, ring_size=64)
    sched = SlabScheduler(remote_config(redis_url, host_slots=8), slab,
                          metrics=Metrics(registry=CollectorRegistry(), namespace=NS))
    try:
        assert [sched.lookup(k) for k in ks] == [Lookup.RETRY] * 3
        assert sched.lookup(b"never-stored") is Lookup.RETRY
        deadline = time.monotonic() + DEADLINE_S
        while sched.core.n_in_flight[JobKind.FETCH] or sched.core.remote.want_token is not None:
            assert time.monotonic() < deadline
            sched.tick()
        assert [sched.lookup(k) for k in ks] == [Lookup.HIT] * 3
        assert sched.lookup(b"never-stored") is Lookup.MISS or sched.core.remote.miss_ttl == 0.0
        p = sched.prepare_load(ks)
        for slot, k in zip(p.slots, ks):
            assert bytes(slab.rows[slot].numpy().tobytes()) == bytes(content(k, ROW).numpy().tobytes())
    finally:
        sched.close()
        slab.close()
        slab.unlink()


def test_a_remote_write_of_many_blocks_is_one_job_against_max_inflight(managers: Any, fresh_redis: Any) -> None:
    """A step's remote writes are one job: they must not crowd the engine's own stores out."""
    fresh_redis.pause(30.0, mode="WRITE")   # the writes stay in flight while the engine goes on
    a = managers(remote_config(fresh_redis.url, max_inflight_jobs=4, remote_timeout_seconds=20.0,
                               remote_write_deadline_seconds=60.0, remote_tomb_ttl_seconds=300), rows=16)
    store_all(a, keys(8, "first"))
    assert a._core.n_in_flight[JobKind.PUT] == 1
    store_all(a, keys(8, "second"), first_row=8)
    assert metric(a, "tiered_kv_shed_total", kind="store", reason="inflight_limit") == 0
    assert a.lookup(keys(8, "second")) == 8
    fresh_redis.unpause()


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("url, named", [("http://u:pw@h:1/0", "unknown scheme"), ("redis://u:pw@h:port/0", "port"),
                                        ("redis//h:1", "expected scheme")])
def test_a_bad_remote_url_is_refused_naming_it_without_its_password(url: str, named: str) -> None:
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError, match=named) as info:
        TieredKVConfig(namespace=NS, host_capacity_bytes=ROW, remote_url=url)
    assert "pw" not in str(info.value)


def test_a_tombstone_shorter_than_a_write_can_be_in_flight_is_refused() -> None:
    from tiered_kv.errors import ConfigError

    # a write is refused past half a tombstone's lifetime from when it was queued: half must exceed the longest a
    # write can be in flight, 10 + 2 x 1 s
    with pytest.raises(ConfigError, match="remote_tomb_ttl_seconds=24 must exceed twice"):
        TieredKVConfig(namespace=NS, host_capacity_bytes=ROW, remote_url="redis://h:1",
                       remote_tomb_ttl_seconds=24, remote_write_deadline_seconds=10.0, remote_timeout_seconds=1.0)
    TieredKVConfig(namespace=NS, host_capacity_bytes=ROW, remote_url="redis://h:1", remote_tomb_ttl_seconds=25,
                   remote_write_deadline_seconds=10.0, remote_timeout_seconds=1.0)


def test_the_password_is_not_in_the_configs_repr_and_env_fields_parse() -> None:
    cfg = TieredKVConfig.from_env(environ={"TIERED_KV_NAMESPACE": NS, "TIERED_KV_HOST_CAPACITY_BYTES": str(ROW),
                                           "TIERED_KV_REMOTE_URL": "redis://u:secret@h:1/0",
                                           "TIERED_KV_REMOTE_TTL_SECONDS": "none",
                                           "TIERED_KV_REMOTE_TIMEOUT_SECONDS": "0.5"})
    assert cfg.remote_url == "redis://u:secret@h:1/0" and cfg.remote_ttl_seconds is None
    assert cfg.remote_timeout_seconds == 0.5
    assert "secret" not in repr(cfg)


def test_a_server_that_is_not_there_is_no_error_at_construction(managers: Any) -> None:
    from redis_servers import free_port

    a = managers(remote_config(f"redis://127.0.0.1:{free_port()}/0", remote_timeout_seconds=0.2))
    assert metric(a, "tiered_kv_healthy", tier="remote") == 0
    assert metric(a, "tiered_kv_errors_total", tier="remote", error="connection") >= 1
    store_all(a, keys(2, "alone"))
    assert a.lookup(keys(2, "alone")) == 2


def test_a_key_invalidated_while_it_is_probed_is_not_fetched(redis_url: str, managers: Any) -> None:
    """The probe's answer (the server holds it) is applied after the invalidate: no slot, no fetch."""
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    k = b"probed-then-invalidated"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    b.lookup([k])
    b.poll()                                    # the probe is sent; its answer is applied at a later poll
    probe = next(j for j in b._core.jobs.values() if j.kind is JobKind.FETCH)
    assert not probe._entries
    b.invalidate(k)
    until(lambda: b._core.n_in_flight[JobKind.FETCH] == 0, b, "the probe's answer")
    assert b._core.index.used_slots == 0
    assert metric(b, "tiered_kv_transfer_bytes_total", src="remote", dst="host") == 0


def test_flush_is_false_when_an_invalidation_it_covers_was_dropped(redis_url: str, managers: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An INVALIDATE the server refuses TOMB_ATTEMPTS times is dropped: the server may still hold the old
    value, so the flush that covered it must not say everything queued before it landed."""
    import redis.exceptions as RE
    from tiered_kv.remote.writer import TOMB_ATTEMPTS
    a = managers(remote_config(redis_url))
    k = b"flush-after-a-dropped-invalidation"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    writer = a._core.remote.store._w
    real = writer.conn.round_trip
    refusals = [0]

    def round_trip(cmds: list[Any]) -> list[Any]:   # the server refuses every script (not a breaker kind)
        refusals[0] += 1
        return [RE.ResponseError("OOM command not allowed when used memory > 'maxmemory' (test)")] * len(cmds)

    monkeypatch.setattr(writer.conn, "round_trip", round_trip)
    a.invalidate(k)
    assert a.flush(timeout=DEADLINE_S) is False
    assert refusals[0] >= TOMB_ATTEMPTS and a._core.remote.store.tombs_dropped == 1
    monkeypatch.setattr(writer.conn, "round_trip", real)
    assert a.flush(timeout=DEADLINE_S), "a later flush covers no dropped op"
