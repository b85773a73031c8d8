"""Adversarial review (round 12) of 7b29277 (remote tier: CANCEL's TYPE check, ``Writer._lost``'s window,
``Writer._died``'s ``_busy``, lock-free read order) and e015ad0 (operator tools: import carries a number
>= SEQ_CHECKED just below it; export measures touches against ``archive._top_seq``).

What it proved wrong (each fixed; each test fails without its fix):

1. ``test_import_keeps_the_source_order_of_entries_numbered_past_seq_checked``: import renumbers *every*
   frame numbered SEQ_CHECKED or more to the same SEQ_CHECKED - 1, so their order on the source is lost:
   recovery on the destination broke the tie by LMDB key order and could evict the source's newest first.
   Fixed: pass 1 collects those numbers and pass 2 maps them below SEQ_CHECKED in their order.
2. ``test_export_drops_a_touch_recovery_drops_when_the_high_entry_is_tombstoned``: ``_top_seq`` counts an
   entry recovery purges (written under a tombstoned token; also one whose header key is not its LMDB key):
   export keeps a touch record numbered past SEQ_CHECKED that recovery drops as damage, and signs a block the
   source orders by its write as the newest.  Fixed: ``_top_seq`` skips what recovery removes.
3. ``test_wait_idle_does_not_answer_idle_before_a_dead_read_batchs_reports_are_put``: 7b29277 fixed
   ``Writer._died`` (``_busy`` cleared on the restart path before the dead batch was answered) but not its twin
   ``Reader._died``: ``wait_idle`` answered True while the dead read batch's report was not on the queue.
   Fixed as the writer's.
4. ``test_no_key_goes_unasked_before_lost_holds_more_than_lost_max_keys``: the 90 % rule of 7b29277 makes every
   key unasked (``lost_all_until``) once ``lost`` is full and fewer than a tenth of it expired -- at 90 % of
   LOST_MAX live keys plus one -- where docs/remote.md says "past 100,000 such keys".  Fixed: ``lost`` is kept
   in expiry order and pruned from its front; only past LOST_MAX live keys is no key asked for.
5. ``test_a_dropped_invalidation_keeps_its_key_unasked_while_a_skewed_write_may_land``: ``Writer._lost``'s
   window (drop + tomb_ttl / 2 + ttl) ignores the clock difference docs/remote.md allows (up to half a
   tombstone's lifetime): a write queued before the drop lands up to a whole tombstone's lifetime later.
   Fixed: the window is drop + tomb_ttl + ttl.

Also here (passing): a seeded property test -- the entries recovery keeps on the destination after export +
import, in LRU order, equal recovery's on the source, for tiers with random touch records (some damage, some of
the wrong length), tombstoned tokens, foreign entries and at most one entry numbered past SEQ_CHECKED (neither
of cases 1 and 2).

Deterministic: tmp_path, seeded RNG; orderings are forced with the store's test hook, a held queue ``put``, a
relay that holds one write and a skewed writer clock.  Test 5 lets real time pass (a value's TTL and a lost
key's window are the point), with margins of 0.7 s or more.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from test_ops_common import NS, ROW, build_env, cli, content, keys, raw_put
from test_review_ops2 import _entry
from test_remote_store import WAIT_S, Gate, blocks, poll, rig  # noqa: F401  (rig: the fixture)
from test_review_remote3 import HoldingRelay, relay  # noqa: F401  (relay: the fixture)
from test_review_round11_remote import _drop_invalidation, _server_away
from test_review_round11_misc import _archive_seqs
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.disk import recovery
from tiered_kv.disk import store as disk_store
from tiered_kv.disk.format import lmdb_key
from tiered_kv.disk.recovery import SEQ_CHECKED, U64
from tiered_kv.remote import writer as writer_mod

pytestmark = pytest.mark.timeout(60)


def _recovered(path, monkeypatch):
    """[(key, seq)] oldest first, as recovery returns it at a TierManager's open of ``path`` (in-process I/O)."""
    got = []

    def spy(*a, **kw):
        r = recovery.recover(*a, **kw)
        got.append([(e.key, e.seq) for e in r[0]])
        return r
    with monkeypatch.context() as m:
        m.setattr(disk_store, "recover", spy)
        cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=4 * ROW, disk_path=path,
                             disk_capacity_bytes=256 * ROW, disk_io="thread")
        TierManager(cfg, torch.zeros((8, ROW), dtype=torch.uint8), registry=CollectorRegistry()).close()
    assert len(got) == 1
    return got[0]


def _round_trip(tmp_path, src, capsys, name="dst"):
    arch = tmp_path / f"{name}.tkv"
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(arch), "--no-progress")
    assert rc == 0, (rc, out, err)
    dst = tmp_path / name
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 0, (rc, out, err)
    return arch, dst


# =========================================================================== 1. two frames renumbered alike
def test_import_keeps_the_source_order_of_entries_numbered_past_seq_checked(tmp_path, capsys, monkeypatch):
    """docs/operations.md (import): an entry numbered SEQ_CHECKED or more "is carried just below it (re-signed;
    still the newest)"; "the destination's LRU orders imported entries by their last use on the source node".

    ``_import_pass`` (tools/archive.py:591) maps every such number to the one value SEQ_CHECKED - 1.  A source
    whose writer got past SEQ_CHECKED numbers *all* its later writes and touches there (recovery keeps them:
    disk/recovery.py:104-107), so several frames carry such numbers; on the destination they all tie, and
    recovery (recovery.py:158, a stable sort over the LMDB cursor order) orders them by key bytes.  Here
    ``old`` (SEQ_CHECKED + 1) and ``new`` (SEQ_CHECKED + 2): the source's LRU evicts ``old`` first, the
    destination's ``new`` first (b"new" < b"old").  Fix: renumber the frames past SEQ_CHECKED keeping their
    order (e.g. a two-pass import mapping the archive's highest to SEQ_CHECKED - 1 and the others below it by
    their distance, or ranks), or refuse them as before."""
    src = build_env(tmp_path / "src", keys(2))
    raw_put(src, "blocks", lmdb_key(b"old"), _entry(b"old", token=8, seq=SEQ_CHECKED + 1))
    raw_put(src, "blocks", lmdb_key(b"new"), _entry(b"new", token=9, seq=SEQ_CHECKED + 2))
    _arch, dst = _round_trip(tmp_path, src, capsys)
    want = [k for k, _ in _recovered(src, monkeypatch)]
    assert want[-2:] == [b"old", b"new"], want
    got = [k for k, _ in _recovered(dst, monkeypatch)]
    assert got == want, f"LRU order (oldest first) on the source {want}, on the destination {got}"


# =========================================================================== 2. _top_seq counts a purged entry
def test_export_drops_a_touch_recovery_drops_when_the_high_entry_is_tombstoned(tmp_path, capsys, monkeypatch):
    """docs/operations.md (export): "An entry's recency is the newer of its write and its touch record, except
    a touch record recovery would drop as damage (it has no checksum: disk.recovery.touch_limit), which is not
    signed into the archive"; e015ad0: ``_top_seq`` is "the highest sequence number of an entry recovery keeps".

    ``_top_seq`` (tools/archive.py:548-562) skips only unparsable, >= SEQ_LIMIT and unverifiable entries; it
    counts ``late`` (SEQ_CHECKED, checksum valid) although its token is tombstoned -- recovery purges it
    (disk/recovery.py:108-111) before taking ``seq`` -- so export's limit is SEQ_LIMIT while recovery's is
    SEQ_CHECKED (recovery.py:141).  k0000's touch record SEQ_CHECKED + 1 is damage to recovery (the source
    orders k0000 by its write, oldest) but export signs it into the archive (k0000 the newest), and the
    destination's LRU evicts k0001 where the source's evicts k0000.  The same for an entry whose header key is
    not its LMDB key (recovery: foreign; ``_top_seq`` passes ``key=None`` to verify_entry).  Fix: skip in
    ``_top_seq`` what recovery removes -- tombstoned tokens, ``lmdb_key(h.key) != lk``, other namespace/length
    (as export's own loop does)."""
    src = build_env(tmp_path / "src", keys(3))
    tok = uuid.UUID(int=11)
    raw_put(src, "blocks", lmdb_key(b"late"), _entry(b"late", token=11, seq=SEQ_CHECKED))   # checksum valid
    raw_put(src, "tombs", tok.bytes, b"late")                       # ... written under a tombstoned token
    raw_put(src, "touch", lmdb_key(b"k0000"), U64.pack(SEQ_CHECKED + 1))   # damage, to recovery
    arch, dst = _round_trip(tmp_path, src, capsys)
    want = [k for k, _ in _recovered(src, monkeypatch)]
    assert want == keys(3), want   # late purged, the touch dropped: write order
    seqs = _archive_seqs(arch)
    got = [k for k, _ in _recovered(dst, monkeypatch)]
    assert got == want, (f"LRU order (oldest first) on the source {want}, on the destination {got} (archive "
                         f"seqs {seqs})")


# =========================================================================== 3. property: round trip vs recovery
@pytest.mark.parametrize("seed", range(10))
def test_round_trip_serves_what_recovery_serves_on_the_source(tmp_path, capsys, monkeypatch, seed):
    """Recovery on the destination after export + import returns the same entries in the same LRU order as
    recovery on the source (export first: recovery changes the source)."""
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    ks = keys(n)
    src = build_env(tmp_path / "src", ks)
    high = rng.random() < 0.6
    extra = []
    for i in range(rng.randint(0, 4)):           # entries of other writers, some tombstoned, one maybe high
        k = f"x{i}".encode()
        tok = 100 + i
        seq = SEQ_CHECKED + rng.randint(0, 5) if (high and i == 0) else rng.randint(1, 50)
        raw_put(src, "blocks", lmdb_key(k), _entry(k, token=tok, seq=seq))
        if i and rng.random() < 0.3:
            raw_put(src, "tombs", uuid.UUID(int=tok).bytes, k)
        extra.append(k)
    if rng.random() < 0.5:                          # a foreign entry: another namespace
        raw_put(src, "blocks", b"f0", _entry(b"f0", ns=b"other", token=200, seq=rng.randint(1, 50)))
    for k in rng.sample(ks + extra, rng.randint(0, len(ks))):   # touch records, some damage
        r = rng.random()
        if r < 0.2 and not high:
            t = SEQ_CHECKED + rng.randint(0, 9)       # damage: recovery and export drop it
        elif r < 0.3:
            raw_put(src, "touch", lmdb_key(k), b"bad")   # wrong length: damage
            continue
        else:
            t = rng.randint(1, 80)
        raw_put(src, "touch", lmdb_key(k), U64.pack(t))
    _arch, dst = _round_trip(tmp_path, src, capsys)
    want = [k for k, _ in _recovered(src, monkeypatch)]
    got = [k for k, _ in _recovered(dst, monkeypatch)]
    assert got == want, (seed, want, got)


# =========================================================================== 4. Reader._died's _busy
def test_wait_idle_does_not_answer_idle_before_a_dead_read_batchs_reports_are_put(rig: Any, redis_url: str) -> None:  # noqa: F811
    """RemoteStore.wait_idle: "Block until everything queued so far was sent and answered".

    7b29277 moved ``Writer._died``'s ``self._busy = False`` into the gone-for-good branch (round 11 proved that
    on the restart path ``wait_idle`` answered idle before the dead batch's puts were answered).  ``Reader._died``
    (tiered_kv/remote/reader.py:257) still clears ``_busy`` for both branches under the lock, and puts the dead
    batch's reports (``done``, ``done_before``: reader.py:259-262) only after releasing it, before the restarted
    thread sets ``_busy`` again.  In between, ``IOThread.wait_idle``'s predicate holds: ``wait_idle`` answers True
    while the fetch's report (REMOTE_DOWN) is not on the completion queue.  The dying thread is held between its
    unlock and its report by a wrapper of its queue's ``put`` (a thread switch there).  Fix: as in the writer,
    clear ``_busy`` only when gone for good (the restarted thread clears it once idle)."""
    h = rig.open(redis_url)
    (k,), _ = blocks(1)
    r = h.store._r
    real_out = r._out
    answering, checked = threading.Event(), threading.Event()

    class HeldOut:
        def put(self, rep: Any) -> None:
            if not answering.is_set():   # the dying thread's first report
                answering.set()
                checked.wait(10.0)
            real_out.put(rep)

        def __getattr__(self, name: str) -> Any:
            return getattr(real_out, name)

    r._out = HeldOut()
    h.store.set_test_hook(Gate("read", block_from=None, raise_at={1: RuntimeError("reader killed (test)")}))
    token, _bufs = h.fetch_async([k])
    assert answering.wait(WAIT_S), "the reader thread did not die"
    try:
        idle = h.store.wait_idle(2.0)
        report = h.q.get(0)
    finally:
        checked.set()
    assert h.store.healthy   # restarted (1 of MAX_RESTARTS)
    assert not idle or report is not None, f"wait_idle answered True with the fetch's report not put ({report})"


# =========================================================================== 5. lost's 90 % rule
def test_no_key_goes_unasked_before_lost_holds_more_than_lost_max_keys(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md: "an invalidation dropped unsent keeps the key unasked until a value written before it has
    expired there ... and past 100,000 such keys no key is asked for until then"; writer.py's module docstring:
    "past ``LOST_MAX`` such keys, no key is (``lost_all_until``)".

    7b29277 changed ``Writer._lost`` (tiered_kv/remote/writer.py:181-187): when the map is full it drops the
    expired entries and, if at least ``LOST_MAX * 9 // 10`` remain, moves *everything* to ``lost_all_until`` --
    so with LOST_MAX (lowered to 100 here) entries of which 10 expired, the 91st live lost key turns off every
    remote read (``RemoteStore.invalidating`` True for any key) until the last of them expired: ttl + half a
    tombstone's life (an hour with the defaults) -- with 91 % of the documented bound.  The amortisation
    (the scan once per tenth of LOST_MAX) is bought with a remote tier that goes dark early.  Fix: keep the
    documented bound (overflow only when ``len(lost) >= LOST_MAX`` after the scan) and amortise otherwise, e.g.
    keep ``lost`` in expiry order (``until`` only grows: re-insert on update) and pop expired ones from the
    front on each add -- O(expired) per call, no full scan; or update the docs to the 90 % rule.  Fixed: the
    expiry-ordered map, pruned from its front (the ten expired here leave at the first add)."""
    monkeypatch.setattr(writer_mod, "LOST_MAX", 100)
    h = rig.open(redis_url, ttl_seconds=600)
    w = h.store._w
    with w._cond:
        now = time.monotonic()
        for i in range(10):                      # ten lost keys whose values have expired since (their windows over)
            w.lost[b"r12-expired-%d" % i] = now - 1.0
        for i in range(90):                      # ninety still in their window
            w._lost(b"r12-live-%d" % i)
        assert not w.lost_all_until
        w._lost(b"r12-live-90")                  # the 91st live one
    assert not h.store.invalidating(b"r12-never-invalidated"), (
        f"a key never invalidated is not asked for with 91 lost keys (LOST_MAX 100): lost_all_until is "
        f"{w.lost_all_until - time.monotonic():.0f} s ahead, {len(w.lost)} keys named")
    with w._cond:
        for i in range(91, 100):                 # LOST_MAX live ones: still named
            w._lost(b"r12-live-%d" % i)
        assert len(w.lost) == 100 and not w.lost_all_until
        w._lost(b"r12-live-100")                 # past LOST_MAX: no key is asked for (the documented bound)
    assert h.store.invalidating(b"r12-never-invalidated") and not w.lost


# =========================================================================== 6. _lost and the clocks
def test_a_dropped_invalidation_keeps_its_key_unasked_while_a_skewed_write_may_land(
        rig: Any, relay: HoldingRelay, redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md (Faults): a write in flight "is refused by its script once half a tombstone's lifetime has
    passed since it was queued (the server's clock against the writer's: clocks may differ by up to that
    much)"; "an invalidation dropped unsent keeps the key unasked until a value written before it has expired
    there".

    The publish deadline is the *writer's* wall clock + tomb_ttl / 2 (writer.py:366-367), compared with the
    *server's* TIME: with the writer's clock ahead by s (< tomb_ttl / 2, allowed) a write queued at Q lands up
    to Q + tomb_ttl / 2 + s, i.e. up to a whole tombstone's lifetime after Q.  That is why the tombstone bound
    is 2x the time in flight.  7b29277's ``Writer._lost`` (writer.py:177) keeps a dropped invalidation's key
    unasked only until drop + tomb_ttl / 2 + ttl: the skew is left out.  Here ttl 2 s, tombs 6 s, the writer's
    clock 2.5 s ahead: k's write queued at Q is held on the network and delivered at Q + 4 (server deadline
    Q + 5.5), lives until Q + 6; its INVALIDATE dropped at ~Q + 0.3 leaves ``lost`` at ~Q + 5.3, when
    ``RemoteStore.invalidating(k)`` turns False while the server still holds the pre-invalidation value.  Fix:
    ``until = now + self._tomb_ttl + self._ttl`` (the script's latest landing, skew included, plus the life)."""
    class Skewed:   # the writer machine's wall clock, 2.5 s ahead of the server's
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def time() -> float:
            return time.time() + 2.5
    monkeypatch.setattr(writer_mod, "time", Skewed())
    h = rig.open(relay.url, ttl_seconds=2, tomb_ttl_seconds=6, write_deadline_s=1.0, timeout_s=0.2)
    (k,), (d,) = blocks(1)
    raw = redis_server.client()
    relay.arm(h.names.tag(k).encode())
    queued = time.monotonic()
    h.put_async([k], [d])                        # queued before the invalidation; its bytes held on the network
    assert h.report().failed == {0: "timeout"}
    _server_away(h.store, monkeypatch)
    _drop_invalidation(h.store, k, monkeypatch)  # k's INVALIDATE will never run
    while time.monotonic() < queued + 4.0:       # past Q + tomb_ttl / 2, inside the server-side deadline Q + 5.5
        time.sleep(0.01)
    relay.deliver()
    assert raw.exists(h.names.value(k)) == 1, "setup: the write in flight did not land"
    poll("the lost key's window lapsed", lambda: not h.store.invalidating(k), 8.0)
    assert raw.exists(h.names.value(k)) == 0, (
        "k is asked for again while the server still holds the value written before its dropped invalidation")
