"""The remote store's faults against real servers: down at start, killed mid-batch and restarted empty,
out of memory, slow (paused), cluster redirections during a slot migration, a cluster failover.

Every fault degrades to failed or missed parts with their error kind, counted through ``on_error``;
nothing raises into the owner and no fetch ever returns wrong bytes.  Waits poll a condition with a
deadline; the I/O threads are held by a :class:`Gate` where an ordering matters.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest

from redis_servers import RedisCluster, RedisServer
from test_remote_store import BLOCK, Gate, Rig, blocks, poll, rig  # noqa: F401  (rig: the fixture)
from tiered_kv.remote import REMOTE_DOWN

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

FAST_BREAKER = dict(breaker_failures=1, breaker_backoff_min_s=0.05, breaker_backoff_max_s=0.2)


def test_server_down_at_start_then_up(rig: Rig, redis_server_factory: Any) -> None:
    s: RedisServer = redis_server_factory(start=False)
    h = rig.open(s.url, timeout_s=0.5, **FAST_BREAKER)
    assert not h.store.available and h.store.put_room() == 0
    keys, data = blocks(2)
    assert not h.store.submit_puts([uuid.uuid4()] * 2, keys, [memoryview(d) for d in data])
    assert not h.store.submit_fetch(uuid.uuid4(), keys, [memoryview(bytearray(BLOCK)) for _ in keys])
    h.store.invalidate(keys[0])                    # kept while the server is away, sent once it is back
    kinds = h.error_kinds()
    assert kinds[0] == "connection" and kinds.count("breaker_open") == 1
    s.start()
    poll("the store found the server", lambda: h.store.available)
    assert h.store.put_room() == h.opts.queue_blocks
    h.idle()
    assert s.command("EXISTS", h.names.tomb(keys[0])) == 1, "the invalidate queued while down was lost"
    assert h.put(keys[1:], data[1:])[1].ok
    assert h.fetch(keys[1:])[1] == data[1:]


def test_close_while_the_server_is_away_does_not_wait(rig: Rig, redis_server_factory: Any) -> None:
    s: RedisServer = redis_server_factory(start=False)
    h = rig.open(s.url, timeout_s=0.5, breaker_failures=1, breaker_backoff_min_s=30.0)
    h.store.invalidate(b"k")
    assert not h.store.wait_idle(0.05)             # a tombstone op waits for the server: not idle
    t0 = time.monotonic()
    h.store.close(timeout=5.0)
    assert time.monotonic() - t0 < 2.0, "close() waited for a server that is away"
    assert h.store.tombs_dropped == 1


def test_server_killed_mid_batch_and_restarted_empty(rig: Rig, fresh_redis: RedisServer) -> None:
    h = rig.open(fresh_redis.url, timeout_s=0.5, **FAST_BREAKER)
    keys, data = blocks(6)
    assert h.put(keys[:2], data[:2])[1].ok
    gate = Gate("write")
    h.store.set_test_hook(gate)
    tokens = h.put_async(keys[2:4], data[2:4], kick=False)
    h.store.invalidate(keys[0])                    # in the same batch: must survive the failed trip
    h.store.kick()
    gate.entered(1)                                # taken, about to be sent
    queued = h.put_async(keys[4:6], data[4:6])     # behind it in the queue
    fresh_redis.stop()                             # SIGKILL
    gate.open()
    r = h.report()
    assert r.token == tokens[0] and not r.ok and set(r.failed or {}) == {0, 1}
    assert set((r.failed or {}).values()) == {"connection"}
    r = h.report()
    assert r.token == queued[0] and r.failed == {0: REMOTE_DOWN, 1: REMOTE_DOWN}   # breaker: at once
    assert not h.store.available and h.store.put_room() == 0
    assert h.error_kinds().count("breaker_open") == 1
    h.store.set_test_hook(None)
    fresh_redis.start()                            # empty, no scripts cached
    poll("the store found the restarted server", lambda: h.store.available)
    r, got = h.fetch(keys[:2])
    assert r.failed == {0: "miss", 1: "miss"}      # restarted empty: misses, not errors
    h.idle()
    assert fresh_redis.command("EXISTS", h.names.tomb(keys[0])) == 1, "the failed invalidate was not sent again"
    assert h.put(keys[2:4], data[2:4])[1].ok
    assert h.fetch(keys[2:4])[1] == data[2:4]


def test_out_of_memory_noeviction_fails_puts_with_oom(rig: Rig, redis_server_factory: Any) -> None:
    s = redis_server_factory("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    size = 64 << 10
    h = rig.open(s.url, block_bytes=size, batch_blocks=4)
    keys, data = blocks(80, size)                  # 5 MiB: past maxmemory
    ok: list[int] = []
    oom = 0
    for i in range(0, 80, 4):
        _, r = h.put(keys[i:i + 4], data[i:i + 4])
        failed = r.failed or {}
        assert set(failed.values()) <= {"oom"}, failed
        oom += len(failed)
        ok += [i + j for j in range(4) if j not in failed]
    assert oom > 0 and ok, (oom, len(ok))
    assert h.error_kinds().count("oom") == oom
    assert h.store.available, "an OOM answer is not an unreachable server"
    r, got = h.fetch([keys[i] for i in ok])
    assert r.ok and got == [data[i] for i in ok]
    h.store.invalidate(keys[ok[0]])                # DEL first: works under OOM
    h.idle()
    assert s.command("EXISTS", h.names.value(keys[ok[0]])) == 0


def test_out_of_memory_with_eviction_gives_misses(rig: Rig, redis_server_factory: Any) -> None:
    s = redis_server_factory("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    size = 64 << 10
    h = rig.open(s.url, block_bytes=size, batch_blocks=4)
    keys, data = blocks(80, size)
    for i in range(0, 80, 8):
        r = h.put(keys[i:i + 8], data[i:i + 8])[1]
        assert r.ok or set((r.failed or {}).values()) <= {"oom"}
    r, got = h.fetch(keys)
    hits = [i for i, g in enumerate(got) if g is not None]
    assert set((r.failed or {}).values()) == {"miss"} and hits, "evicted keys are misses"
    assert all(got[i] == data[i] for i in hits)
    assert not h.corrupt


def test_slow_server_times_out_opens_breaker_and_recovers(rig: Rig, fresh_redis: RedisServer) -> None:
    h = rig.open(fresh_redis.url, timeout_s=0.2, breaker_failures=2, breaker_backoff_min_s=0.05,
                 breaker_backoff_max_s=0.1)
    keys, data = blocks(3)
    assert h.put(keys[:1], data[:1])[1].ok
    fresh_redis.pause(1.5)                         # CLIENT PAUSE ALL: replies held, connections open
    assert h.put(keys[1:2], data[1:2])[1].failed == {0: "timeout"}
    assert h.store.available                       # one failed trip of two
    assert h.fetch(keys[:1])[0].failed == {0: "timeout"}   # the reader's trip: the second in a row
    poll("the breaker opened", lambda: not h.store.available)
    assert h.store.put_room() == 0 and h.error_kinds().count("breaker_open") == 1
    assert h.error_kinds().count("timeout") == 2
    assert not h.store.submit_fetch(uuid.uuid4(), keys[:1], [memoryview(bytearray(BLOCK))])
    poll("the store recovered once the pause ended", lambda: h.store.available)
    assert h.put(keys[2:], data[2:])[1].ok
    assert h.fetch(keys[:1])[1] == data[:1]


def test_write_pause_does_not_delay_fetches(rig: Rig, fresh_redis: RedisServer) -> None:
    h = rig.open(fresh_redis.url, timeout_s=5.0)
    keys, data = blocks(2)
    assert h.put(keys[:1], data[:1])[1].ok
    fresh_redis.pause(3, mode="WRITE")             # scripts wait, GETs are served
    tok = h.put_async(keys[1:], data[1:])          # the writer thread now waits on its reply
    r, got = h.fetch(keys[:1])                     # the reader's own connection is not behind it
    assert r.ok and got == data[:1]
    assert h.store.queue_depth == 1, "the put was answered before the pause ended"
    fresh_redis.unpause()
    r = h.report()
    assert r.token == tok[0] and r.ok


def test_debug_sleep_is_a_timeout(rig: Rig, fresh_redis: RedisServer) -> None:
    h = rig.open(fresh_redis.url, timeout_s=0.2, breaker_failures=5)
    keys, data = blocks(1)
    fresh_redis.sleep(1.5)                         # the whole server blocks
    assert h.put(keys, data)[1].failed == {0: "timeout"}
    poll("the server woke", lambda: fresh_redis.command("PING"))
    assert h.put(keys, data)[1].ok


def _slot_keys(h: Any, cluster: RedisCluster, slot: int, n: int) -> list[bytes]:
    """``n`` block keys whose names hash to ``slot`` (found by trying random keys)."""
    out: list[bytes] = []
    while len(out) < n:
        k = os.urandom(12)
        if cluster.keyslot(h.names.value(k).encode()) == slot:
            out.append(k)
    return out


def test_cluster_slot_migration_moved_and_ask(rig: Rig, redis_cluster_url: str, redis_cluster: RedisCluster) -> None:
    h = rig.open(redis_cluster_url, batch_blocks=16)
    keys, data = blocks(24)
    assert h.put(keys, data)[1].ok
    slot = redis_cluster.keyslot(h.names.value(keys[0]).encode())
    hot = [keys[0]] + _slot_keys(h, redis_cluster, slot, 3)   # 4 blocks in the migrating slot
    hot_data = [data[0]] + [os.urandom(BLOCK) for _ in range(3)]
    assert h.put(hot[1:3], hot_data[1:3])[1].ok
    src = redis_cluster.master_of_slot(slot)
    dst = next(m for m in redis_cluster.masters() if m is not src)
    redis_cluster.begin_migration(slot, src, dst)
    assert redis_cluster.move_keys(slot, src, dst, count=2) >= 1   # some of the slot's keys moved: ASK for those
    r, got = h.fetch(keys + hot[:3])               # one batch: some parts answered ASK, followed
    assert r.ok and got == data + hot_data[:3]
    # puts into a migrating slot: published (ASK followed) or failed "cluster" (TRYAGAIN), never wrong
    _, r = h.put([hot[3]], [hot_data[3]])
    assert r.ok or set((r.failed or {}).values()) == {"cluster"}
    while redis_cluster.move_keys(slot, src, dst):
        pass
    redis_cluster.finish_migration(slot, dst)      # the store's slot table is stale now: MOVED
    newer = [os.urandom(BLOCK) for _ in hot]
    _, r = h.put(hot, newer)
    assert r.ok, r
    r, got = h.fetch(keys[1:] + hot)
    assert r.ok and got == data[1:] + newer
    assert dst.command("EXISTS", h.names.value(hot[0])) == 1
    redis_cluster.migrate_slot(slot, src)          # give it back: the session cluster stays as it was
    assert h.fetch(hot)[1] == newer


@pytest.mark.slow
def test_cluster_failover_after_master_dies(rig: Rig, redis_cluster_replicated: RedisCluster) -> None:
    c = redis_cluster_replicated
    h = rig.open(c.url, timeout_s=0.5, batch_blocks=16, breaker_failures=3, breaker_backoff_min_s=0.05,
                 breaker_backoff_max_s=0.2)
    keys, data = blocks(30)
    assert h.put(keys, data)[1].ok
    for m in c.masters():
        m.command("WAIT", 1, 5000)                 # replicated before the kill
    victim = c.masters()[0]
    replica = c.kill_master(victim)
    _, r = h.put(keys, data)                       # during the outage: parts on the dead master fail
    assert r.ok or set((r.failed or {}).values()) <= {"connection", "cluster", "timeout", REMOTE_DOWN}
    c.failover(replica)

    def all_back() -> bool:
        if not h.store.available:
            return False
        r, got = h.fetch(keys)
        return r.ok and got == data
    poll("every key readable after the failover", all_back, 20.0)
    newer = [os.urandom(BLOCK) for _ in keys]
    _, r = h.put(keys, newer)
    assert r.ok, r
    assert h.fetch(keys)[1] == newer
