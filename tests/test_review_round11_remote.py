"""Round 11 adversarial review of the remote tier: the fixes of commit 6362c21 (round 10's findings).

What it proved wrong (fixed; each test fails without its fix, but 3, a known limit kept as a strict xfail):

1. ``test_a_cancelled_write_does_not_land_over_a_foreign_value_of_another_type``: the WRONGTYPE fix covered the
   reader's GET only; the CANCEL script's GETRANGE aborted on a non-string value before it set the token
   tombstone, so a cancelled job's write in flight landed.  Fixed: CANCEL checks the value's TYPE first.
2. ``test_a_write_in_flight_when_its_invalidation_was_dropped_is_not_asked_for_until_it_expired``: ``Writer._lost``
   counted the value's lifetime from the drop, but a write queued before the invalidation may land up to half a
   tombstone's lifetime after its queueing, i.e. after the drop.  Fixed: that half lifetime is added.
3. ``test_a_dropped_invalidation_keeps_a_peers_value_unasked_until_it_expired``: ``Writer._lost`` uses this
   engine's ``remote_ttl_seconds`` for a value a peer wrote with its own.  A known limit: docs/remote.md now lists
   ``remote_ttl_seconds`` among the settings the engines sharing a namespace must share.
4. ``test_wait_writes_does_not_answer_idle_before_a_dead_batchs_puts_are_answered``: ``Writer._died`` cleared
   ``_busy`` before it answered the dead batch's puts (restart path): ``wait_idle`` / ``wait_writes`` answered
   True while a put was unanswered.  Fixed: cleared only when the thread is gone for good.
5. ``test_invalidating_is_true_for_a_lost_key_while_lost_overflows``: ``RemoteStore.invalidating`` read
   ``lost_all_until`` then ``lost`` without the lock; an overflow between the two reads answered False.  Likewise
   ``test_invalidating_stays_true_while_the_writer_thread_drops_an_invalidation``: ``Writer._dropped`` took the
   key out of ``invalidating`` before ``_lost`` put it in ``lost``.  Fixed: each reads / writes in the safe order.
6. ``test_the_documented_tombstone_ttl_bound_is_the_one_enforced``: docs/remote.md's options table still stated
   the old bound.  Fixed: the table.
7. ``test_the_remote_benchmarks_store_options_are_accepted``: benchmarks/remote_raw.py's store options were
   refused.  Fixed: ``store_options`` carries tombstones past the bound.

Orderings are forced with the store's test hook (Gate), a relay that holds one write (HoldingRelay), a
monkeypatched probe, ``_answer`` and ``_lost``, an ACL that refuses one command; tests 2 and 3 let real time
pass (a value's TTL and a lost key's window are the point).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import pytest

from test_remote_store import WAIT_S, Gate, blocks, poll, rig  # noqa: F401  (rig: the fixture)
from test_review_remote3 import HoldingRelay, relay  # noqa: F401  (relay: the fixture)

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

import redis.exceptions as RE  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _server_away(store: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Trip the breaker and keep it open (the writer's probe fails) while the returned event is set."""
    away = threading.Event()
    away.set()
    real_ping = store._w.conn.ping

    def ping() -> None:
        if away.is_set():
            raise RE.ConnectionError("the server is away (test)")
        real_ping()

    monkeypatch.setattr(store._w.conn, "ping", ping)
    store.breaker.trip("test: the server is away")
    return away


def _drop_invalidation(store: Any, k: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invalidate ``k`` while the server is away and have that INVALIDATE dropped (the oldest beyond TOMB_CAP,
    lowered to 2 as round 10's finding 4 did)."""
    from tiered_kv.remote import writer as writer_mod
    monkeypatch.setattr(writer_mod, "TOMB_CAP", 2)
    before = store.tombs_dropped
    store.invalidate(k)
    store.invalidate(b"r11-other-1-" + uuid.uuid4().bytes)
    store.invalidate(b"r11-other-2-" + uuid.uuid4().bytes)
    assert store.tombs_dropped == before + 1
    assert k in store._w.lost


# =========================================================================== 1. CANCEL over another type
def test_a_cancelled_write_does_not_land_over_a_foreign_value_of_another_type(
        rig: Any, relay: HoldingRelay, redis_server: Any) -> None:  # noqa: F811
    """docs/remote.md, Guarantees: "a cancelled job's write never becomes visible, even when it reaches the server
    late"; RemoteStore.cancel: "refused by a token tombstone if late"; "the store is shared and untrusted" and
    (Faults, commit 6362c21) a value of another type than a string under a block's name is a foreign value.

    Commit 6362c21 made WRONGTYPE on the reader's GET a corrupt value, but the writer's CANCEL script
    (tiered_kv/remote/keys.py:69-76) starts with ``GETRANGE KEYS[1]`` on the value: on a hash that raises
    WRONGTYPE and aborts the script before ``SET KEYS[2]`` (the token tombstone).  The writer sees a script
    error (not a breaker kind), retries it TOMB_ATTEMPTS times and drops it (writer.py ``_send``): no token
    tombstone ever exists, and this job's write -- sent, answered ``timeout`` by the client, its bytes still on
    the network -- is published by its script (RENAME overwrites the hash) when it arrives.  Fix: check
    ``TYPE`` first in CANCEL (a non-string value cannot be this token's: skip the delete), or SET the token
    tombstone before the GETRANGE / use ``pcall``."""
    h = rig.open(relay.url, timeout_s=0.2)
    (k,), (d,) = blocks(1)
    raw = redis_server.client()
    raw.hset(h.names.value(k), "field", "written by something else sharing the server")
    relay.arm(h.names.tag(k).encode())          # the write's bytes are held on the network
    (tok,) = h.put_async([k], [d])
    assert h.report().failed == {0: "timeout"}  # the client gave it up; its bytes are still on their way
    h.store.cancel(tok, k)                      # the job is cancelled: its write must never become visible
    assert h.store.wait_writes(WAIT_S)
    assert relay.caught.is_set()
    relay.deliver()                              # the network delivers the write now (well inside its deadline)
    v = raw.get(h.names.value(k)) if raw.type(h.names.value(k)) == b"string" else None
    assert v is None or uuid.UUID(bytes=v[28:44]) != tok, (
        f"the cancelled write was published (cancel dropped: tombs_dropped={h.store.tombs_dropped}, "
        f"errors {h.error_kinds()})")


# =========================================================================== 2. a write in flight outlives `lost`
def test_a_write_in_flight_when_its_invalidation_was_dropped_is_not_asked_for_until_it_expired(
        rig: Any, relay: HoldingRelay, redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md, Faults: "an invalidation dropped unsent keeps the key unasked until a value written before
    it has expired there (remote_ttl_seconds ...)"; "A write carries a deadline of half a tombstone's lifetime
    from when it was queued" (so a write queued before an invalidation may reach the server that late).

    ``Writer._lost`` (tiered_kv/remote/writer.py:172-187) sets ``until = now + ttl`` at the drop.  A write of k
    queued at Q (before the invalidation) and delayed on the network lands at L, up to Q + tomb_ttl / 2 --
    after the drop when the INVALIDATE is dropped at once (TOMB_CAP while the server is away, or a writer gone
    for good) -- and lives until L + ttl.  Between drop + ttl and L + ttl ``RemoteStore.invalidating(k)`` is
    False (and the core's guard of tomb_ttl has lapsed) while the server holds the pre-invalidation value:
    this machine asks for it and serves what it invalidated.  Here: ttl 2 s, tombs 6 s; k's write is queued at
    Q, its INVALIDATE dropped at ~Q + 0.3, the write delivered at Q + 1.5 (before its Q + 3 deadline); ``lost``
    lapsed at ~Q + 2.3, the value lives until ~Q + 3.5.  Fixed: the key is kept unasked for ``ttl + tomb_ttl``
    (the latest a write queued before the drop can land, with the clock difference the deadline allows, plus its
    lifetime: round 12)."""
    h = rig.open(relay.url, ttl_seconds=2, tomb_ttl_seconds=6, write_deadline_s=1.0, timeout_s=0.2)
    (k,), (d,) = blocks(1)
    raw = redis_server.client()
    relay.arm(h.names.tag(k).encode())
    queued = time.monotonic()
    h.put_async([k], [d])                        # queued before the invalidation; its bytes held on the network
    assert h.report().failed == {0: "timeout"}
    _server_away(h.store, monkeypatch)
    _drop_invalidation(h.store, k, monkeypatch)  # k's INVALIDATE will never run
    while time.monotonic() < queued + 1.5:       # inside the write's deadline (queued + tomb_ttl / 2)
        time.sleep(0.01)
    relay.deliver()
    assert raw.exists(h.names.value(k)) == 1, "setup: the write in flight did not land"
    poll("the lost key's window lapsed", lambda: not h.store.invalidating(k), 10.0)   # (drop + tomb_ttl + ttl)
    assert raw.exists(h.names.value(k)) == 0, (
        "k is asked for again while the server still holds the value written before its dropped invalidation")


# =========================================================================== 3. a peer's TTL
@pytest.mark.xfail(strict=True, reason=(
    "a known limit (docs/remote.md, Faults): the engines sharing a namespace must use the same remote_ttl_seconds; "
    "a dropped invalidation keeps its key unasked as long as this engine's values live"))
def test_a_dropped_invalidation_keeps_a_peers_value_unasked_until_it_expired(
        rig: Any, redis_url: str, redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md, Faults: "an invalidation dropped unsent keeps the key unasked until a value written before
    it has expired there (remote_ttl_seconds; for good without one)"; the limits named there require the engines
    sharing a namespace to agree on ``remote_tomb_ttl_seconds`` and ``remote_write_deadline_seconds`` only, so
    engines with different ``remote_ttl_seconds`` are a supported deployment.

    ``Writer._lost`` (tiered_kv/remote/writer.py:176) uses ``self._ttl``, this engine's.  Machine B (the
    defaults: values live an hour) wrote k; machine A (``ttl_seconds=1``) invalidates k while the server is away
    and the INVALIDATE is dropped.  One second later ``A.store.invalidating(k)`` is False (and A's core guard of
    ``remote_tomb_ttl_seconds`` = 1 s has lapsed), while the server holds B's pre-invalidation value for an hour:
    A's next lookup fetches back and serves the bytes it invalidated.  Fix: keep a dropped INVALIDATE's key and
    send it again once the server is back (the key set is small), or name remote_ttl_seconds among the settings
    engines must share (and fall back to "for good" when in doubt)."""
    a = rig.open(redis_url, ttl_seconds=1, tomb_ttl_seconds=1, write_deadline_s=0.2, timeout_s=0.1)
    b = rig.open(redis_url)                      # a peer: the defaults (ttl 3600 s)
    (k,), (d,) = blocks(1)
    _, r = b.put([k], [d])
    assert r.ok
    raw = redis_server.client()
    _server_away(a.store, monkeypatch)
    _drop_invalidation(a.store, k, monkeypatch)
    poll("the lost key's window lapsed", lambda: not a.store.invalidating(k), 5.0)
    assert raw.exists(a.names.value(k)) == 0, (
        "A asks for k again while the server still holds the value a peer wrote before A's dropped invalidation")


# =========================================================================== 4. wait_writes before the answers
def test_wait_writes_does_not_answer_idle_before_a_dead_batchs_puts_are_answered(
        rig: Any, redis_url: str) -> None:  # noqa: F811
    """RemoteStore.wait_idle: "Block until everything queued so far was sent and answered"; wait_writes: "until
    every write op queued so far -- puts, cancels, invalidations -- was sent and answered".

    Commit 6362c21 added ``self._busy = False`` to ``Writer._died`` (tiered_kv/remote/writer.py:500) for both
    branches.  In the restart branch the dead batch's puts are answered only after the lock is released
    (``self._answer(answers)``, writer.py:503: ``puts_pending`` decremented, the job's report put), and the
    restarted thread sets ``_busy`` again only later.  In between, ``IOThread.wait_idle``'s predicate
    (nothing queued, not busy, healthy) holds: ``wait_writes`` answers True while ``queue_depth`` is 1 and the
    put's report is not on the queue.  Before the fix ``_busy`` stayed set (the dead thread's ``_next`` set it)
    until the restarted thread went idle.  (The core's ``flush`` waits for the put reports first, so it is
    not affected; tests, benchmarks and tools that use ``wait_idle`` as "everything answered" are.)  The dying
    thread is held between its unlock and its answers by a wrapper of ``_answer`` -- a thread switch there.
    Fix: clear ``_busy`` only in the branch where the thread is gone for good, or after ``_answer``."""
    h = rig.open(redis_url)
    (k,), (d,) = blocks(1)
    w = h.store._w
    real_answer = w._answer
    answering, checked = threading.Event(), threading.Event()

    def answer(answers: list[Any]) -> None:
        if answers and not answering.is_set():   # the dying thread's answers (the breaker is closed)
            answering.set()
            checked.wait(10.0)
        real_answer(answers)

    w._answer = answer
    h.store.set_test_hook(Gate("write", block_from=None, raise_at={1: RuntimeError("writer killed (test)")}))
    h.put_async([k], [d])
    assert answering.wait(WAIT_S), "the writer thread did not die"
    try:
        idle = h.store.wait_writes(2.0)
        depth = h.store.queue_depth
        report = h.q.get(0)
    finally:
        checked.set()
    assert h.store.healthy   # restarted (1 of MAX_RESTARTS)
    assert not idle or (depth == 0 and report is not None), (
        f"wait_writes answered True with {depth} put unanswered and no report put (report={report})")


# =========================================================================== 5. the overflow between two reads
def test_invalidating_is_true_for_a_lost_key_while_lost_overflows(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """RemoteStore.invalidating (tiered_kv/remote/store.py:159-173): True for a key whose INVALIDATE was dropped,
    until a value written before it expired; "Reads of the writer's maps without its lock (a dict lookup each:
    atomic under the GIL)".

    Each read is atomic, the pair is not.  ``Writer._lost`` (writer.py:181-186), on the writer or reader thread
    (a dropped op: ``_send``, ``_give_up_tombs``, ``_drop_oldest_tomb`` from the reader's ``drop``), sets
    ``lost_all_until`` and then clears ``lost``.  The owner checks ``now < lost_all_until`` first (still 0), then
    ``lost.get(key)`` (cleared): False for a key that both the old and the new state keep unasked.  The overflow
    is forced here between the owner's two reads (a dict whose ``get`` lets another thread run ``_lost`` first,
    as a thread switch there would; LOST_MAX lowered to 2).  Fix: read ``lost.get`` first, then
    ``lost_all_until`` (the writer sets it before it clears), or take the lock when ``lost`` is non-empty."""
    from tiered_kv.remote import writer as writer_mod
    monkeypatch.setattr(writer_mod, "LOST_MAX", 2)
    h = rig.open(redis_url)
    w = h.store._w
    k1, k2, k3 = (b"r11-lost-%d" % i for i in range(3))
    _server_away(h.store, monkeypatch)
    monkeypatch.setattr(writer_mod, "TOMB_CAP", 1)
    h.store.invalidate(k1)
    h.store.invalidate(k2)     # k1's INVALIDATE dropped
    h.store.invalidate(b"r11-lost-x")   # k2's dropped
    assert set(w.lost) == {k1, k2} and not w.lost_all_until

    class Switching(collections.OrderedDict):   # type: ignore[type-arg]
        switched = False

        def get(self, key: Any, default: Any = None) -> Any:
            if not Switching.switched:
                Switching.switched = True

                def other() -> None:   # another thread drops one more INVALIDATE: lost overflows
                    with w._cond:
                        w._lost(k3)
                t = threading.Thread(target=other)
                t.start()
                t.join(5.0)
            return super().get(key, default)

    with w._cond:
        w.lost = Switching(w.lost)
    assert h.store.invalidating(k1), (
        f"invalidating(k1) answered False while lost_all_until={w.lost_all_until:.1f} "
        f"(now {time.monotonic():.1f}) covers it")


def test_invalidating_stays_true_while_the_writer_thread_drops_an_invalidation(
        rig: Any, fresh_redis: Any) -> None:  # noqa: F811
    """RemoteStore.invalidating (tiered_kv/remote/store.py:159-173): True while an INVALIDATE of the key has not
    run on the server, and once it was dropped until a value written before it expired; read without the lock.

    ``Writer._dropped`` (tiered_kv/remote/writer.py:163-170) calls ``_invalidate_done(op)`` (the key leaves
    ``invalidating``) and only then ``_lost(op.key)`` (it enters ``lost``).  On the writer thread (an
    INVALIDATE the server refused TOMB_ATTEMPTS times: here an ACL forbids the script's SET) an owner reading
    between the two statements sees the key in neither map and asks the server for it.  The test reads
    ``invalidating`` at that instant (``_lost`` wrapped: what any other thread sees while
    the writer thread is there).  Fix: ``_lost`` before ``_invalidate_done`` in ``_dropped`` (and
    ``lost.get`` before ``lost_all_until`` in ``invalidating``, the previous test)."""
    raw = fresh_redis.client()
    # an ACL user whose scripts may not SET: the INVALIDATE's tomb SET is refused (a script error) every time
    raw.acl_setuser("r11", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-set"])
    h = rig.open(f"redis://r11:pw@127.0.0.1:{fresh_redis.port}/0")
    w = h.store._w
    (k,), _ = blocks(1)
    seen: list[bool] = []
    real_lost = w._lost

    def lost(key: bytes) -> None:
        if key == k:
            seen.append(h.store.invalidating(k))
        real_lost(key)

    w._lost = lost
    h.store.invalidate(k)
    h.store.kick()
    poll("the INVALIDATE was dropped", lambda: h.store.tombs_dropped == 1, 5.0)
    assert "script" in h.error_kinds() and k in w.lost
    assert seen == [True], "invalidating(k) answered False while the writer thread dropped k's INVALIDATE"


# =========================================================================== 6. the options table
def test_the_documented_tombstone_ttl_bound_is_the_one_enforced() -> None:
    """What it proved wrong: docs/remote.md's options table still gave the old bound (``remote_tomb_ttl_seconds``
    must exceed ``remote_write_deadline_seconds + 2 * remote_timeout_seconds``) after 6362c21 doubled it: 20 s
    tombs with the default 10 s write deadline and 1 s timeout, valid by the table, were refused.  Fixed: the
    table states the bound the config enforces (checked here on both sides of it)."""
    from pathlib import Path

    from tiered_kv import TieredKVConfig
    from tiered_kv.errors import ConfigError
    doc = (Path(__file__).resolve().parent.parent / "docs" / "remote.md").read_text()
    assert "must exceed `2 * (remote_write_deadline_seconds + 2 * remote_timeout_seconds)`" in doc
    kw = dict(namespace="r11|u8|tp0", host_capacity_bytes=1 << 20, remote_url="redis://127.0.0.1:1/0",
              remote_write_deadline_seconds=10.0, remote_timeout_seconds=1.0)
    TieredKVConfig(remote_tomb_ttl_seconds=25, **kw)          # 25 > 2 x (10 + 2 x 1)
    with pytest.raises(ConfigError):
        TieredKVConfig(remote_tomb_ttl_seconds=24, **kw)


# =========================================================================== 7. the remote benchmark's options
def test_the_remote_benchmarks_store_options_are_accepted() -> None:
    """What it proved wrong: ``benchmarks/remote_raw.py`` (cited for the tier's raw figures) built its stores with
    ``write_deadline_s=600``, ``timeout_s=10`` and the default 120 s tombstones, which ``RemoteStore`` refuses
    (``tomb_ttl_problem``): the benchmark could not run.  Fixed: its options (``store_options``) carry tombstones
    past the bound."""
    import importlib.util
    from pathlib import Path

    from tiered_kv.remote import RemoteStore
    from tiered_kv.reports import CompletionQueue
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "remote_raw.py"
    spec = importlib.util.spec_from_file_location("remote_raw_under_test", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    store = RemoteStore(bench.store_options("redis://127.0.0.1:1/0", 4096, 32), CompletionQueue())   # nobody answers
    store.close(timeout=0.5)
