"""Second adversarial review of the remote tier (tiered_kv/remote/*, core/remote_tier.py).

What it proved wrong, each pinned by a test that failed before its fix: a key invalidated while the server
was away for longer than the tomb's TTL was fetched back and served once it returned (the INVALIDATE still
queued), and a burst of misses could trim away a live invalidation guard; one tombstone op into a slot
being migrated throttled every write of every slot; a ``password=`` query parameter was echoed in errors
and the options' repr showed the url's password; malformed IPv6 host parts connected elsewhere; a
RemoteStore took options that let a late write outlive its tombstone; tombstones dropped on overflow
were counted as breaker openings.  The plain tests pin tricky behaviour that is right and would break
silently.  Orderings are forced with the
store's test hook (an I/O thread held between taking a batch and sending it), a monkeypatched round
trip or probe, or a clock shim for the core's own time-outs -- never by sleeping.
"""

from __future__ import annotations

import threading
import time
import types
import uuid
from typing import Any, Optional

import pytest

from test_remote_store import WAIT_S, blocks, entry, poll, rig  # noqa: F401  (rig: the fixture)
from test_remote_tier import DEADLINE_S, NS, ROW, managers, remote_config, store_all, until  # noqa: F401
from tiered_kv import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.jobs import JobKind

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

import redis.exceptions as RE  # noqa: E402
from test_review_remote import HoldWriter, settled  # noqa: E402  (the store hook and the fetch test of the first review)


def clock_ahead(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The core's remote tier (only it) sees the clock ``seconds`` ahead: its miss and tomb guards lapse."""
    from tiered_kv.core import remote_tier
    shim = types.SimpleNamespace(monotonic=lambda: time.monotonic() + seconds)
    monkeypatch.setattr(remote_tier, "time", shim)


# =========================================================================== findings, fixed

# --------------------------------------------------------------------------- an invalidation's guard lapses
def test_an_invalidated_key_is_not_fetched_back_after_an_outage_longer_than_the_tomb_ttl(
        redis_url: str, managers: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """invalidate(k) while the server is away: the INVALIDATE waits in the writer's queue (tombstone ops are
    never shed) and `RemoteTier.invalidate` guards k for `tomb_ttl` seconds from now.  The server is away for
    longer (a partition: it keeps its values); when it is back the writer sends the INVALIDATE, but nothing
    orders it before the next lookup's probe and GET on the reader's connection -- the old value is served."""
    a = managers(remote_config(redis_url))
    k = b"review2-invalidated-during-an-outage"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    store = a._core.remote.store
    writer = store._w
    real_ping = writer.conn.ping
    away = threading.Event()
    away.set()

    def ping() -> None:   # the writer's probe: the server does not answer while `away`
        if away.is_set():
            raise RE.ConnectionError("the server is away (test)")
        real_ping()

    monkeypatch.setattr(writer.conn, "ping", ping)
    store.breaker.trip("test: the server is away")
    a.invalidate(k)
    assert a.lookup([k]) == 0
    clock_ahead(monkeypatch, a.config.remote_tomb_ttl_seconds + 1.0)   # the outage outlasts the tomb TTL
    hold = HoldWriter()
    store.set_test_hook(hold)
    try:
        away.clear()   # back: the next probe closes the breaker, the writer takes the INVALIDATE (held here)
        until(lambda: store.available and hold.entered.is_set(), a, "the breaker closed, the INVALIDATE taken")
        a.lookup([k])
        until(lambda: settled(a), a, "the probe (and any fetch) answered")
        served = a.lookup([k])
    finally:
        hold.release()
    assert a.flush(timeout=DEADLINE_S)
    assert served == 0, "a key invalidated on this machine was fetched back from the server and served"


def test_an_invalidation_guard_is_not_trimmed_away_by_a_burst_of_misses(
        redis_url: str, managers: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """`missed` is bounded (MISSED_MAX, the oldest quarter forgotten) and holds both the 1 s miss marks and the
    invalidation guards of `tomb_ttl` seconds, with expired marks never purged: enough misses after an
    invalidate push its guard out while the INVALIDATE still waits behind the writer's backlog."""
    from tiered_kv.core import remote_tier
    monkeypatch.setattr(remote_tier, "MISSED_MAX", 8)
    a = managers(remote_config(redis_url, remote_miss_ttl_seconds=1.0))
    k = b"review2-guard-trimmed"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    store = a._core.remote.store
    hold = HoldWriter()
    store.set_test_hook(hold)
    try:
        a.invalidate(k)
        a.poll()   # the step ends: the writer takes the INVALIDATE and is held before sending it
        until(lambda: hold.entered.is_set(), a, "the INVALIDATE taken")
        for i in range(12):   # keys the server lacks: each probe's miss is remembered
            assert a.lookup([b"review2-absent-%d" % i]) == 0
            until(lambda: settled(a), a, "the probe of an absent key")
        a.lookup([k])
        until(lambda: settled(a), a, "the probe (and any fetch) of the invalidated key")
        served = a.lookup([k])
    finally:
        hold.release()
    assert a.flush(timeout=DEADLINE_S)
    assert served == 0, "a burst of misses dropped the invalidation's guard: the old value was served"


# --------------------------------------------------------------------------- one migrating slot slows every write
def test_a_tombstone_op_into_a_migrating_slot_does_not_throttle_the_other_slots_writes(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md: a slot being migrated fails its writes "until the migration finishes ... the other slots
    keep working".  The writer retries such an op forever (`attempts` is not counted for "cluster" errors) and
    after each batch that retried one sets `_pause` (doubling, to 1 s) for the *whole* queue.  The TRYAGAIN of
    the INVALIDATE is injected (test_review_remote.py shows a real migrating slot answers it)."""
    h = rig.open(redis_url, batch_blocks=4, write_deadline_s=30.0)
    writer = h.store._w
    stuck, _ = blocks(1)
    stuck_name = h.names.value(stuck[0])
    real = writer.conn.round_trip

    def round_trip(cmds: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(cmds)
        rest = [i for i, c in enumerate(cmds) if not (isinstance(c, tuple) and stuck_name in c)]
        for i, c in enumerate(cmds):
            if i not in rest:
                out[i] = RE.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot")
        for i, r in zip(rest, real([cmds[i] for i in rest]) if rest else []):
            out[i] = r
        return out

    monkeypatch.setattr(writer.conn, "round_trip", round_trip)
    h.store.invalidate(stuck[0])
    h.store.kick()
    poll("the INVALIDATE of the migrating slot tried once", lambda: "cluster" in h.error_kinds())
    keys, data = blocks(30)
    for i in range(0, 30, 3):
        h.put_async(keys[i:i + 3], data[i:i + 3])
    start = time.monotonic()
    reports = []
    while len(reports) < 10 and time.monotonic() - start < 3.0:
        r = h.q.get(0.05)
        if r is not None:
            reports.append(r)
    took = time.monotonic() - start
    assert len(reports) == 10 and all(r.ok for r in reports), (
        f"{3 * len(reports)} of 30 writes of healthy slots answered in {took:.1f} s while one tombstone op of a "
        f"migrating slot is retried")


# --------------------------------------------------------------------------- urls and options
@pytest.mark.parametrize("url", ["redis://cache:6379/0?password=s3cr3t",
                                 "redis://cache:6379/0?username=u&password=s3cr3t",
                                 "unix:///run/redis.sock?db=0&password=s3cr3t"])
def test_a_password_query_parameter_is_not_echoed_in_the_error(url: str) -> None:
    """redis-py's `from_url` takes any query parameter as a connection argument, `?password=` included; the
    tier refuses the parameter (fine) but names the url with it (url.py:138, `redact_url` only redacts user
    info)."""
    with pytest.raises(ConfigError) as info:
        TieredKVConfig(namespace=NS, host_capacity_bytes=ROW, remote_url=url)
    assert "s3cr3t" not in str(info.value), str(info.value)


@pytest.mark.parametrize("url, why", [("redis://[::1]6380", "the port after ']' is dropped: 6379 is used"),
                                      ("redis://[::1", "an unclosed '[' is taken as a host"),
                                      ("redis://::1", "an unbracketed IPv6 address is read as host ':' port 1"),
                                      ("redis://fe80::1", "read as host 'fe80:' port 1")])
def test_a_malformed_host_part_is_refused(url: str, why: str) -> None:
    from tiered_kv.remote.url import parse_url
    with pytest.raises(ConfigError):
        t = parse_url(url)
        print(f"{url!r} parsed as {t.hosts}: {why}")


@pytest.mark.parametrize("bad", [dict(tomb_ttl_seconds=5, write_deadline_s=10.0),
                                 dict(write_deadline_s=float("inf")),
                                 dict(timeout_s=float("nan"))])
def test_remote_options_that_break_the_tombstone_bound_are_refused(bad: dict[str, Any]) -> None:
    """`RemoteStore` (public: the benchmarks and tools build it from `RemoteOptions`) promises a ConfigError for
    bad options (store.py:57); only `TieredKVConfig` checks the bound the tombstones rely on."""
    from tiered_kv.remote import RemoteOptions, RemoteStore
    from tiered_kv.reports import CompletionQueue
    opts = RemoteOptions(url="redis://127.0.0.1:1/0", namespace=NS, block_bytes=ROW, **bad)
    with pytest.raises(ConfigError):
        store = RemoteStore(opts, CompletionQueue())
        store.close(timeout=0.1)


def test_remote_options_repr_does_not_show_the_password() -> None:
    from tiered_kv.remote import RemoteOptions
    opts = RemoteOptions(url="redis://user:s3cr3t@cache:6379/0", namespace=NS, block_bytes=ROW)
    assert "s3cr3t" not in repr(opts), repr(opts)


# --------------------------------------------------------------------------- a metric that lies
def test_tombstone_overflow_is_not_counted_as_breaker_openings(rig: Any, redis_url: str,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/remote.md: the breaker opening is "counted once as `breaker_open`"; writer.py `_drop_oldest_tomb`
    reports every dropped op under the same label, so a dashboard's breaker openings count dropped tombstones."""
    from tiered_kv.remote import writer as writer_mod
    monkeypatch.setattr(writer_mod, "TOMB_CAP", 2)
    h = rig.open(redis_url)
    monkeypatch.setattr(h.store._w.conn, "ping", lambda: (_ for _ in ()).throw(RE.ConnectionError("away")))
    h.store.breaker.trip("test: the server is away")
    keys, _ = blocks(6)
    for k in keys:
        h.store.invalidate(k)
    assert h.store.tombs_dropped == 4
    assert h.error_kinds().count("breaker_open") == h.store.breaker.openings == 1, h.error_kinds()


# =========================================================================== right (plain tests)

def test_a_value_arriving_whole_is_verified_before_it_is_copied(rig: Any, redis_url: str,  # noqa: F811
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET answered through a cluster redirection (`rc.execute_command`) comes back as plain bytes, not read
    into the slot: reader.py verifies it with `verify_entry` against *this part's* key, namespace and block
    length before copying it.  Another key's good entry of the same length, or a peer's entry of another block
    size, never reaches the buffer; the part's own good entry does."""
    from tiered_kv.remote import FETCH_CORRUPT
    from tiered_kv.remote.keys import KeyNames
    h = rig.open(redis_url)
    keys, data = blocks(3)
    names: KeyNames = h.names
    wire = {names.value(keys[0]): entry(names, keys[0], data[0]),            # the part's own value
            names.value(keys[1]): entry(names, keys[0], data[1]),            # key 0's entry under key 1's name
            names.value(keys[2]): entry(names, keys[2], data[2] * 2)}        # a peer with twice the block size
    reader = h.store._r
    monkeypatch.setattr(reader.conn, "round_trip", lambda cmds: [wire[c.name] for c in cmds])
    token, bufs = h.fetch_async(keys)
    r = h.report()
    assert r.token == token and r.failed == {1: FETCH_CORRUPT, 2: FETCH_CORRUPT}, r
    assert bytes(bufs[0]) == data[0]
    assert bufs[1] == bufs[2] == bytearray([0xEE]) * h.opts.block_bytes, "an unverified value was copied"
    assert sorted(h.corrupt) == ["wrong_key", "wrong_length"], h.corrupt


def test_breaker_opens_once_backs_off_to_its_cap_and_resets_after_closing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe back-off doubles per failed probe up to its cap (never hammering a down server), a close
    resets it (the next outage probes early again), and concurrent failures open the breaker -- and count
    the opening -- exactly once."""
    from tiered_kv.remote import breaker as breaker_mod
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(breaker_mod, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    opened: list[str] = []
    changes: list[bool] = []
    release = threading.Event()

    def on_open(msg: str) -> None:
        opened.append(msg)
        release.wait(WAIT_S)   # the first opener is held here while others fail

    b = breaker_mod.Breaker(3, 0.5, 4.0, on_open, lambda: changes.append(b.closed))
    assert not b.failure("1") and not b.failure("2")
    b.success()                                   # an answer restarts the count
    assert not b.failure("1") and not b.failure("2") and b.closed
    first = threading.Thread(target=b.failure, args=("3",))
    first.start()
    poll("the opener in on_open", lambda: len(opened) == 1)
    assert [b.failure("more") for _ in range(5)] == [False] * 5 and not b.trip("again")
    release.set()
    first.join(WAIT_S)
    assert not b.closed and b.openings == 1 and len(opened) == 1
    assert b.probe_in() == pytest.approx(0.5)
    for want in (1.0, 2.0, 4.0, 4.0):
        b.probe_failed()
        assert b.probe_in() == pytest.approx(want)
    clock.now += 4.0
    assert b.probe_in() == 0.0
    b.success()
    assert b.closed and changes == [False, True]
    assert b.trip("down again") and b.probe_in() == pytest.approx(0.5), "the back-off was not reset by the close"


def test_a_tombstone_op_outlives_failed_round_trips_and_lands(rig: Any, redis_url: str,  # noqa: F811
                                                              redis_server: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A tombstone op is never shed while the server answers: two lost connections and more TRYAGAINs (a slot
    in migration) than TOMB_ATTEMPTS later, the INVALIDATE still lands -- a fix of the whole-queue pause must
    not "fix" it by counting a migration's TRYAGAIN as a refusal."""
    from tiered_kv.remote.writer import TOMB_ATTEMPTS
    h = rig.open(redis_url)
    keys, data = blocks(1)
    assert h.put(keys, data)[1].ok
    writer = h.store._w
    real = writer.conn.round_trip
    faults = [RE.ConnectionError("lost (test)")] * 2 + \
        [RE.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot")] * (TOMB_ATTEMPTS + 1)

    def round_trip(cmds: list[Any]) -> list[Any]:
        if faults:
            return [faults.pop(0)] * len(cmds)
        return real(cmds)

    monkeypatch.setattr(writer.conn, "round_trip", round_trip)
    h.store.invalidate(keys[0])
    assert h.store.wait_writes(WAIT_S)
    assert not faults and h.store.tombs_dropped == 0
    raw = redis_server.client()
    assert raw.exists(h.names.tomb(keys[0])) == 1 and raw.exists(h.names.value(keys[0])) == 0
    assert h.store.available


def test_a_fetch_split_over_batches_is_answered_once_when_the_breaker_opens_between_them(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A fetch of 5 parts with batch_blocks=2: its first batch fails (the server is away), the breaker opens
    meanwhile; the 3 parts still queued are answered remote_down by `_take_all` (a partly taken job).  One
    report, each part answered once, and nothing left pending."""
    from test_remote_store import Gate
    from tiered_kv.remote import REMOTE_DOWN
    h = rig.open(redis_url, batch_blocks=2)
    keys, data = blocks(5)
    assert h.put(keys, data)[1].ok
    store, reader = h.store, h.store._r
    monkeypatch.setattr(store._w.conn, "ping", lambda: (_ for _ in ()).throw(RE.ConnectionError("away")))
    monkeypatch.setattr(reader.conn, "round_trip", lambda cmds: [RE.ConnectionError("lost (test)")] * len(cmds))
    gate = Gate("read")
    store.set_test_hook(gate)
    token, _ = h.fetch_async(keys)
    gate.entered(1)                                # the first two parts taken, not sent
    store.breaker.trip("test: the server went away")
    gate.open()
    r = h.report()
    assert r.token == token and r.failed == {0: "connection", 1: "connection", 2: REMOTE_DOWN, 3: REMOTE_DOWN,
                                             4: REMOTE_DOWN}, r
    assert reader.parts_pending == 0 and h.q.get(0.2) is None, "a part was answered twice"


def test_the_miss_memory_is_bounded_and_keeps_the_latest() -> None:
    """`RemoteTier.missed` never holds more than MISSED_MAX keys (a stream of new prompts misses forever) and
    what it forgets first is the oldest noted."""
    from tiered_kv.core.remote_tier import MISSED_MAX, RemoteTier
    tier = RemoteTier(types.SimpleNamespace(available=True), None, miss_ttl=60.0, prefetch=8,  # type: ignore[arg-type]
                      tomb_ttl=120)
    now = time.monotonic()
    n = MISSED_MAX + MISSED_MAX // 2
    for i in range(n):
        tier.note_miss(b"k%d" % i, now)
    assert len(tier.missed) <= MISSED_MAX
    assert tier.recently_missed(b"k%d" % (n - 1), now) and not tier.recently_missed(b"k0", now)
    assert not tier.recently_missed(b"k%d" % (n - 1), now + 61.0)
