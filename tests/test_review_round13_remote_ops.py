"""Adversarial review (round 13) of the remote tier and the archive tool as changed by 3e4bd18 (``Writer._lost``
kept in expiry order and pruned from its front; ``Reader._died``'s ``_busy``; import renumbering past
SEQ_CHECKED through pass 1's ``_Summary.high``; ``_top_seq`` skipping what recovery removes), 7b29277, 6362c21
and e015ad0.

What it proved wrong (each test fails without its fix):

1. ``test_a_key_lost_again_does_not_make_expired_keys_count_toward_lost_max`` -- ``Writer._lost``
   (tiered_kv/remote/writer.py:173-197).  docs/remote.md (Faults): "an invalidation dropped unsent keeps the
   key unasked until a value written before it has expired there ..., and past 100,000 such keys no key is
   asked for until then".  3e4bd18 keeps ``lost`` "in expiry order" and prunes expired keys from its front
   only, stopping at the first live one; but a key lost *again* is updated in place (``lost[key] = until``
   keeps its dict position with a later expiry -- the docstring's "which only delays the pruning behind it").
   Every expired key behind it then stays in the map and counts toward ``len(lost) >= LOST_MAX``: the overflow
   fires with a handful of keys in their window and sets ``lost_all_until`` -- *no* key is fetched from the
   server for ``tomb_ttl + ttl`` (an hour with the defaults), the whole remote tier dark.  Why it matters: one
   key lost again pins every later entry until its own new window ends, e.g. two ``reset_cache`` calls during
   outages that each overflow TOMB_CAP re-lose the keys held both times; once the first drops' windows are over,
   the map is full of expired keys and the next drop overflows although almost none is live.  Here, through the public API (``invalidate()``
   with the server away and TOMB_CAP lowered to 1 so each call drops the one before; LOST_MAX lowered to 100;
   a shimmed monotonic clock, no waiting), the 101st drop overflows with 4 keys in their window.  Suggested
   fix: keep the order true -- move a re-lost key to the end without it ever leaving the map (an
   ``OrderedDict`` and ``move_to_end``, atomic under the GIL for a lock-free reader), or, before overflowing,
   sweep the whole map for expired keys once (rare: only when it looks full) and overflow only if LOST_MAX
   live keys remain.  Fixed: ``lost`` is an ``OrderedDict`` and a key lost again moves to its end.

2. ``test_import_keeps_entries_past_seq_checked_newer_than_those_just_below_it`` -- ``import_async``'s
   ``renumber`` (tiered_kv/tools/archive.py:673-676, 602-604).  docs/operations.md (import): an entry numbered
   SEQ_CHECKED or more "is carried just below it (re-signed; still the newest, in their order)"; export: "the
   destination's LRU orders imported entries by their last use on the source node".  Round 12's fix maps the
   archive's N distinct numbers >= SEQ_CHECKED onto SEQ_CHECKED - 1 ... SEQ_CHECKED - N but leaves every
   number below SEQ_CHECKED as it is, so the renumbered entries land on top of (tie with, or go below) the
   archive's entries numbered just under SEQ_CHECKED.  That is exactly the tier that holds numbers past
   SEQ_CHECKED: a writer gets there only by counting across it (recovery accepts a touch record below
   SEQ_CHECKED without a checksum and resumes the writer from it), so its entries just below SEQ_CHECKED are
   its next-newest.  Here the source is built by a TierManager: a damaged touch record SEQ_CHECKED - 3 (kept by
   recovery), then four stores numbered SEQ_CHECKED - 2, - 1, + 0, + 1 (n0000..n0003).  After export + import
   the destination numbers them SEQ_CHECKED - 2, - 1, - 2, - 1: n0002 (newer than n0001 on the source) is now
   older than it, and the pairs tie (broken by key order).  The destination's LRU evicts the source's
   second-newest block before older ones.  Suggested fix: renumber from the top down over *all* the archive's
   distinct numbers, ``new = min(seq, previous_new - 1)`` starting from ``min(top, SEQ_CHECKED - 1)``, until a
   number is already below its would-be new number (pass 1 collects the distinct numbers >= SEQ_CHECKED -
   frames, a bounded set); this keeps every frame's order and moves only the numbers it must.  Fixed so
   (``archive._renumbering``; pass 1 scans again for the numbers from SEQ_CHECKED - frames up, only when the
   archive holds one past SEQ_CHECKED).

Checked and found to hold (no test):

* ``RemoteStore.invalidating`` against every writer-side change of ``lost`` / ``lost_all_until`` /
  ``invalidating``: the overflow sets ``lost_all_until`` before it clears ``lost``; the front pruning deletes
  only expired keys; ``_dropped`` and ``_give_up_tombs`` put a key in ``lost`` before taking it out of
  ``invalidating``; a value replaced in place is atomic.  ``_lost``'s window (drop + tomb_ttl + ttl) covers the
  latest landing of a write queued before the drop, skew included; ``ttl None`` keeps the key (and an
  overflow) for good, as documented.
* ``Writer._died`` / ``Reader._died``: every put and fetch part answered exactly once on both paths (the
  dead batch's answered parts through ``_held_answered`` / ``_answered``, a job split over batches completed by
  ``_take_all``); ``_busy`` cleared only when gone for good; in-flight tombstone ops re-queued (each script is
  idempotent or token/sha-matched) with ``tombs_queued`` and ``invalidating`` consistent; a close() racing a
  restart joins the new thread (``IOThread.join`` reads ``_thread`` again after the old one ended).
* ``wait_idle`` / ``wait_writes`` answer at once while the breaker holds tombstone ops (queued or delayed) and
  once a thread is gone for good; ``flush()`` without a timeout returns then (every queued put answered
  ``remote_down`` by ``_take_all_puts``).
* CANCEL's TYPE check (a string shorter than the token offset is left alone and the tomb still set);
  DROP_IF_SAME with no sha never deletes a string; foreign values of other types under the tomb, token-tomb and
  staged names are overwritten by SET / RENAME and seen by EXISTS.
* The publish deadline (queued + tomb_ttl / 2, the writer's wall clock derived from the queueing's monotonic
  time); ``tomb_ttl_problem`` is the one bound, enforced alike by ``TieredKVConfig`` and ``RemoteOptions``
  (integer TTLs, so the writer's ``int()`` loses nothing).
* Archive: ``_top_seq`` equals recovery's highest kept entry for ``touch_limit`` (two records on one slot and a
  slot past the file end included: the loser either fails its checksum or is the older); import's skip /
  replace rules; a number missing from ``renumber`` (an archive changed between the passes) falls back to
  SEQ_CHECKED - 1 and the trailer check still guards it; verify's ``bad_seq`` comes after the checksum and
  before the tombstone check, so verify --repair removes exactly what recovery deletes there.
* Memory: ``_Summary.high`` holds one int per frame numbered that high (bounded by the archive); ``lost`` by
  LOST_MAX; the writer's ``_unsent`` / ``invalidating`` by the queued ops.

Deterministic: tmp_path, a redis-server from tests/redis_servers.py (the ``redis_url`` fixture); orderings are
forced through the public API with the breaker held open (test_review_round11_remote._server_away) and a shimmed
monotonic clock; no sleeps.
"""
from __future__ import annotations

import time
from typing import Any

import pytest

from test_ops_common import build_env, keys, open_manager, raw_put, store_keys
from test_remote_store import rig  # noqa: F401  (rig: the fixture)
from test_review_round11_remote import _server_away
from test_review_round12_remote_ops import _recovered, _round_trip
from tiered_kv.disk.format import lmdb_key
from tiered_kv.disk.recovery import SEQ_CHECKED, U64
from tiered_kv.remote import store as store_mod
from tiered_kv.remote import writer as writer_mod

pytestmark = pytest.mark.timeout(60)


class _Clock:
    """The ``time`` module, with monotonic() ``ahead`` seconds ahead of the real one (set by the test)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


# =========================================================================== 1. a re-lost key stalls the pruning
def test_a_key_lost_again_does_not_make_expired_keys_count_toward_lost_max(
        rig: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/remote.md: "past 100,000 such keys [kept unasked] no key is asked for until then".  See finding 1."""
    monkeypatch.setattr(writer_mod, "LOST_MAX", 100)
    monkeypatch.setattr(writer_mod, "TOMB_CAP", 1)     # each invalidate() drops the one queued before it
    clock = _Clock()
    monkeypatch.setattr(writer_mod, "time", clock)
    monkeypatch.setattr(store_mod, "time", clock)
    h = rig.open(redis_url, ttl_seconds=600)
    s, w = h.store, h.store._w
    window = w._tomb_ttl + 600                     # a dropped invalidation's key is unasked this long
    _server_away(s, monkeypatch)
    s.invalidate(b"r13-front")
    for i in range(98):
        s.invalidate(b"r13-old-%d" % i)            # each drops the one before: front, old-0 .. old-96 lost
    clock.ahead = 10.0
    s.invalidate(b"r13-front")                     # drops old-97
    s.invalidate(b"r13-x")                         # drops front again, 10 s after its first drop
    assert len(w.lost) == 99 and not w.lost_all_until
    clock.ahead = window + 5.0                     # the first 98 windows are over; front's second is not
    s.invalidate(b"r13-new-0")                     # drops x
    now = clock.monotonic()
    live = sum(1 for u in w.lost.values() if u > now)   # front, old-97, x
    s.invalidate(b"r13-new-1")                     # drops new-0
    assert s.tombs_dropped == 102
    assert not s.invalidating(b"r13-never-invalidated"), (
        f"no key is asked for with {live + 1} lost keys in their window (LOST_MAX 100): lost_all_until "
        f"{w.lost_all_until - clock.monotonic():.0f} s ahead")


# =========================================================================== 2. renumbered onto the numbers below
def test_import_keeps_entries_past_seq_checked_newer_than_those_just_below_it(tmp_path, capsys, monkeypatch):
    """docs/operations.md: carried just below SEQ_CHECKED, "still the newest, in their order".  See finding 2."""
    src = build_env(tmp_path / "src", keys(2))
    # a damaged touch record recovery keeps (below SEQ_CHECKED: no checksum to check): the writer resumes from it
    raw_put(src, "touch", lmdb_key(b"k0000"), U64.pack(SEQ_CHECKED - 3))
    mgr, kv = open_manager(src)
    try:
        store_keys(mgr, kv, keys(4, "n"))          # numbered SEQ_CHECKED - 2, - 1, + 0, + 1
    finally:
        mgr.close()
    want = _recovered(src, monkeypatch)
    assert [s - SEQ_CHECKED for _, s in want[-4:]] == [-2, -1, 0, 1], want
    _arch, dst = _round_trip(tmp_path, src, capsys)
    got = _recovered(dst, monkeypatch)
    assert [k for k, _ in got] == [k for k, _ in want], (
        f"LRU order (oldest first) on the source {[(k, s - SEQ_CHECKED) for k, s in want]}, on the destination "
        f"{[(k, s - SEQ_CHECKED) for k, s in got]} (numbers relative to SEQ_CHECKED)")
