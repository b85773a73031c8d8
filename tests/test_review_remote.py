"""Adversarial review of the remote tier (tiered_kv/remote/*, core/remote_tier.py and its use in core/tiers.py).

Each test pins one fix: a password leaked by a url error, an invalidated key fetched back before its
tomb reached the server, a key probed twice in one step (raised from poll()), one migrating cluster
slot opening the breaker for every slot, and a step's probe wider than the reader takes (silently
dropped for ever); beside them, what the fixes must keep (an '@' in a TLS file path, a refused probe
counted and asked again).  Orderings are forced with the store's test hook (an I/O thread held between
taking a batch and sending it) or a monkeypatched call, never by sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from test_remote_store import rig  # noqa: F401  (the fixture)
from test_remote_tier import DEADLINE_S, NS, ROW, managers, remote_config, store_all, until  # noqa: F401
from tiered_kv import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.jobs import JobKind

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")


class HoldWriter:
    """A store test hook that holds the writer thread (after it took a batch, before it sends it) until
    :meth:`release`; the reader runs freely."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, point: str) -> None:
        if point == "write":
            self.entered.set()
            self.gate.wait(DEADLINE_S)

    def release(self) -> None:
        self.gate.set()


def settled(mgr: Any) -> bool:
    core = mgr._core
    return core.n_in_flight[JobKind.FETCH] == 0 and core.remote.want_token is None


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("url", ["redis://user:se/cret@h:6379/0", "redis://user:se#cret@h:6379/0",
                                 "redis://user:se?cret@h:6379/0", "rediss+cluster://u:se/cret@a:1,b:2",
                                 "redis://user:se?cret=1@h:6379/0"])
def test_review_a_malformed_url_error_never_shows_the_password(url: str) -> None:
    """url.py:28 `_USERINFO` stops at the first '/', '?' or '#', so `redact_url` gives up on a password holding
    one and returns the url whole; `parse_url` (url.py:99) cuts the netloc there too and raises a ConfigError
    naming that unredacted url (and the password again, as a 'database' or 'parameter')."""
    with pytest.raises(ConfigError) as info:
        TieredKVConfig(namespace=NS, host_capacity_bytes=ROW, remote_url=url)
    assert "cret" not in str(info.value), str(info.value)


def test_review_an_at_sign_in_a_tls_file_path_is_not_taken_for_user_info() -> None:
    """The rule that refuses user info with an unencoded '/', '?' or '#' leaves a known parameter's value
    alone: a key file's path may hold an '@', and the url is neither refused nor redacted for it."""
    from tiered_kv.remote.url import parse_url, redact_url

    url = "rediss://h:6380/0?ssl_keyfile=/keys/user@host.pem"
    t = parse_url(url)
    assert t.hosts == (("h", 6380),) and dict(t.tls_options)["ssl_keyfile"] == "/keys/user@host.pem"
    assert redact_url(url) == url
    assert redact_url("rediss://u:pw@h:6380/0?ssl_keyfile=/k/u@h.pem") == "rediss://u:***@h:6380/0?ssl_keyfile=/k/u@h.pem"


# --------------------------------------------------------------------------- invalidate, then look up again
def test_review_an_invalidated_key_is_not_fetched_back_before_its_tomb_reaches_the_server(
        redis_url: str, managers: Any) -> None:  # noqa: F811
    """`invalidate(key)`: "never served again until stored again".  The INVALIDATE goes down the writer's
    queue while a later lookup's probe and GET go down the reader's own connection: nothing orders them
    (a writer busy with a backlog of puts is enough), so the server still holds the old value when the
    reader asks, and the invalidated block comes back into the host tier."""
    a = managers(remote_config(redis_url))
    k = b"review-invalidated-then-looked-up"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    hold = HoldWriter()
    a._core.remote.store.set_test_hook(hold)
    try:
        a.invalidate(k)
        assert a.lookup([k]) == 0
        until(lambda: hold.entered.is_set() and settled(a), a, "the probe (and any fetch) answered")
        served = a.lookup([k])
    finally:
        hold.release()
    assert a.flush(timeout=DEADLINE_S)
    assert served == 0, "an invalidated key was fetched back from the server and served again"


def test_review_a_key_wanted_again_after_an_invalidate_in_the_same_step_does_not_crash_poll(
        redis_url: str, managers: Any) -> None:  # noqa: F811
    """lookup(k); invalidate(k); lookup(k) in one step: `RemoteTier.invalidate` pops `asking[k]` but leaves k
    in `want_keys`, so `want` (remote_tier.py:157) appends it a second time.  The probe asks for [k, k];
    when the server holds k, `probe_answered` (remote_tier.py:203) reserves k twice and `TierIndex.reserve`
    raises AssertionError("reserve of present key") out of the engine's poll()."""
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    k = b"review-wanted-twice"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    hold = HoldWriter()              # b's INVALIDATE is not sent yet: the server still holds k for the probe
    b._core.remote.store.set_test_hook(hold)
    try:
        b.lookup([k])
        b.invalidate(k)
        b.lookup([k])
        wanted = list(b._core.remote.want_keys)
        raised = None
        try:
            until(lambda: settled(b), b, "the probe (and any fetch) answered")
        except AssertionError as e:
            raised = e
    finally:
        hold.release()
    assert raised is None, f"poll() raised into the engine: {raised!r} (want_keys was {wanted!r})"


# --------------------------------------------------------------------------- the breaker and one migrating slot
def test_review_a_tombstone_op_into_a_migrating_slot_does_not_open_the_breaker_for_the_whole_tier(
        rig: Any, redis_cluster_url: str, redis_cluster: Any) -> None:  # noqa: F811
    """A slot in migration answers TRYAGAIN to every multi-key script of its keys ("a write into it fails until
    the migration finishes; reads work", docs/remote.md).  A tombstone op is retried alone at the front of the
    writer's queue (writer.py:318-341), each retry a batch whose every op failed "cluster", a BREAKER_KIND
    (conn.py:34), so writer.py:349 counts it as an unreachable server: after `breaker_failures` retries the
    breaker opens and every fetch and put of every other slot is answered remote_down -- and it flaps open
    again after each probe for as long as the migration lasts."""
    from test_remote_store import blocks
    h = rig.open(redis_cluster_url, batch_blocks=16)
    keys, data = blocks(4)
    assert h.put(keys, data)[1].ok
    slot = redis_cluster.keyslot(h.names.value(keys[0]).encode())
    other = next(i for i in range(1, 4) if redis_cluster.keyslot(h.names.value(keys[i]).encode()) != slot)
    src = redis_cluster.master_of_slot(slot)
    dst = next(m for m in redis_cluster.masters() if m is not src)
    redis_cluster.begin_migration(slot, src, dst)
    try:
        h.store.invalidate(keys[0])
        h.store.kick()
        end = time.monotonic() + DEADLINE_S
        while h.store.breaker.openings == 0 and h.error_kinds().count("cluster") < 6:
            assert time.monotonic() < end, f"no retries seen: {h.errors}"
            time.sleep(0.01)
        openings, available = h.store.breaker.openings, h.store.available
    finally:
        for n in (src, dst):
            n.command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert openings == 0 and available, (
        f"one migrating slot opened the breaker {openings} time(s) (available={available}): fetches and puts of "
        f"every other slot are answered remote_down meanwhile; errors {h.error_kinds()}")
    r, got = h.fetch(keys[other:other + 1])
    assert r.ok and got == data[other:other + 1]


# --------------------------------------------------------------------------- a probe larger than the reader's bound
def test_review_a_step_wanting_more_keys_than_the_reader_takes_still_fetches_or_says_so(
        redis_url: str, managers: Any) -> None:  # noqa: F811
    """`remote_prefetch_blocks` (64 by default) keys a step may want, but the reader refuses any job of more
    parts than max(remote_queue_blocks, remote_batch_blocks) (reader.py:54,65).  `take_wanted`
    (remote_tier.py:171) then drops the whole probe -- not counted, not logged -- and the next step wants the
    same keys again: nothing is ever fetched, and the vLLM scheduler answers RETRY for them forever
    (scheduler.py:144).  The config accepts the combination (config.py:223-226)."""
    try:
        cfg = remote_config(redis_url, remote_queue_blocks=4, remote_batch_blocks=4, remote_prefetch_blocks=8)
    except ConfigError:
        return   # refused clearly: fine
    a = managers(remote_config(redis_url))
    b = managers(cfg)
    from disk_helpers import keys as make_keys
    ks = make_keys(8, "review-wide")
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    for _ in range(3):               # three steps, each asking again
        b.lookup(ks)
        until(lambda: settled(b), b, "the step's probe")
    assert b.lookup(ks) > 0, ("8 keys the server holds were wanted for 3 steps and never probed; "
                              f"want() still says 'being asked': {b._core.remote.want(ks[0], b._core.take_token)}")


def test_review_a_probe_the_store_refuses_is_counted_shed_and_asked_again(redis_url: str, managers: Any,  # noqa: F811
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's probe the reader cannot take now (its queue full of fetch parts) is counted as a shed
    FETCH (``backpressure``), not dropped unseen, and the keys are asked for again at a later step."""
    from tiered_kv.metrics import sample_total

    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url))
    ks = [b"review-refused-probe-%d" % i for i in range(4)]
    store_all(a, ks)
    assert a.flush(timeout=DEADLINE_S)
    store = b._core.remote.store
    real = store.submit_probe
    monkeypatch.setattr(store, "submit_probe", lambda token, keys: False)
    assert b.lookup(ks) == 0
    b.poll()                                         # the step's probe is refused
    reg = b.metrics.registry
    assert sample_total(reg, "tiered_kv_shed_total", kind="fetch", reason="backpressure") == len(ks)   # per key
    monkeypatch.setattr(store, "submit_probe", real)
    until(lambda: b.lookup(ks) == len(ks), b, "the keys asked for again after the refused probe")


def test_review_a_key_wanted_again_after_it_was_superseded_is_probed_once() -> None:
    """``superseded(key)`` (the engine stores the key itself) forgets that it is being asked, but this
    step's probe still lists it; a later ``want`` of it in the same step (the store was shed) lists it
    again.  The probe asks for it once: two entries would reserve two host slots for one key."""
    from tiered_kv.core.remote_tier import RemoteTier
    from tiered_kv.jobs import TokenFactory

    class _Store:
        available = True
        probes: list[list[bytes]] = []

        def submit_probe(self, token: Any, keys: list[bytes]) -> bool:
            self.probes.append(list(keys))
            return True

        def invalidating(self, key: bytes) -> bool:
            return False

    tier = RemoteTier(_Store(), None, miss_ttl=1.0, prefetch=8, tomb_ttl=120)   # type: ignore[arg-type]
    tokens = TokenFactory()
    assert tier.want(b"k", tokens) and tier.want(b"j", tokens)
    tier.superseded(b"k")
    assert tier.want(b"k", tokens)
    got = tier.take_wanted()
    assert isinstance(got, tuple) and sorted(got[1]) == [b"j", b"k"], got


def test_review_a_read_into_a_migrating_slot_does_not_count_as_an_unreachable_server(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The reader, like the writer, counts toward the breaker only failures that say the server is away:
    a fetch whose every part failed TRYAGAIN (a slot being migrated) is not one; the same fetch failing
    with a connection error is (the control).  What the reader tells the breaker is recorded (the
    writer's own trips, a status ping, may reset its count meanwhile)."""
    from redis.exceptions import ConnectionError as RedisConnectionError, TryAgainError

    from test_remote_store import blocks
    h = rig.open(redis_url)
    keys, data = blocks(2)
    assert h.put(keys, data)[1].ok
    reader = h.store._r
    told: list[str] = []
    breaker = reader.breaker
    real_failure = breaker.failure
    monkeypatch.setattr(breaker, "failure", lambda *a: (told.append("failure") if threading.current_thread()
                                                         is reader._thread else None, real_failure(*a))[1])
    for exc, verdict in ((TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"), []),
                         (RedisConnectionError("connection refused"), ["failure"])):
        told.clear()
        with monkeypatch.context() as m:
            m.setattr(reader.conn, "round_trip", lambda cmds, exc=exc: [exc] * len(cmds))
            r, _ = h.fetch(keys[:1])
        assert not r.ok
        assert told == verdict, (type(exc).__name__, told, h.error_kinds())
