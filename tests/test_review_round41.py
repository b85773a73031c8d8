"""Review round 41: ``871ff4c`` (disk/readers.py: a record of another writer than expected is verified against its
own fields) and ``7dabc08`` (``S3FIFO.walk``/``restore``; archive ``_mkdirs``/``_rmdirs``).  Each test below failed
on the tree reviewed (0346ca9); all fixed since:

1. an entry an interrupt left out while ``S3FIFO.victim``'s ``finally`` put the passed-over ones back went to the
   FIFO the walk last popped from, not its own: the walk's held lists stay on the policy (``S3FIFO.held``) and
   ``restore`` puts such an entry back in the FIFO that held it;
2. the entry the walk had popped and not placed went back in front of those it had passed over before it (an
   order no uninterrupted run makes; since round 36): ``restore`` moves those back in front of it;
3. another writer's record found under a key's index name was checked against its own namespace and with no
   key, so an intact record copied under another key's name was a quiet miss: it must carry the tier's
   namespace and a key indexed under that name (``readers._same_name``), else it is counted corrupt and removed.

Run: ``PYTHONPATH=. python -m pytest -q tests/test_review_round41.py -p no:cacheprovider``
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from test_interrupt_policy import _sweep
from tiered_kv.core.index import TierIndex
from tiered_kv.core.policy import make_policy
from tiered_kv.disk.format import lmdb_key

from disk_helpers import Rig, rig  # noqa: F401  (rig: the fixture)
from test_review_round39_reads import damaged_record_is_counted_and_removed

pytestmark = pytest.mark.timeout(60)


# ============================================================================ 1. S3-FIFO: restore after a stale walk
N = 8
K = [b"k%d" % i for i in range(N)]


def _s3fifo_leased_small() -> tuple[TierIndex, list[Any]]:
    """S3-FIFO over 8 slots: small [k7, x] (both leased: a load reads each, passed over in place), main [k0..k5]
    (each used once); a reservation of ``y`` then evicts from main, after the walk of small held k7 and x."""
    idx = TierIndex(N, policy=make_policy("s3fifo", N))
    for k in K:
        e = idx.reserve(k, uuid.uuid4())
        assert e is not None
        idx.publish(e)
    idx.ready_run(K[:6])
    e = idx.reserve(b"x", uuid.uuid4())   # evicts k6 (never used); k0..k5 go to main
    assert e is not None
    idx.publish(e)
    leases: list[Any] = [None, None]
    for i, k in enumerate((b"k7", b"x")):
        ent = idx.get(k)
        assert ent is not None
        idx.acquire(ent, leases, i)
    p: Any = idx.policy
    assert (list(p.small), list(p.main)) == ([b"k7", b"x"], K[:6])   # the setup it needs
    return idx, leases


def _fifos(idx: TierIndex) -> tuple[list[bytes], list[bytes], dict[bytes, int], list[bytes]]:
    p: Any = idx.policy
    return list(p.small), list(p.main), dict(p.freq), list(p.ghost)


def _broken_off_reserve_differs(where: str) -> list[str]:
    ref_idx, _ = _s3fifo_leased_small()
    assert ref_idx.reserve(b"y", uuid.uuid4()) is not None
    ref = _fifos(ref_idx)
    wrong: list[str] = []

    def after(st: tuple[TierIndex, list[Any]], label: str) -> None:
        idx, _ = st
        if idx.get(b"y") is None:   # the engine retries the reservation that did not get its entry
            assert idx.reserve(b"y", uuid.uuid4()) is not None
        got = _fifos(idx)
        if got != ref and where in label:
            wrong.append(f"{label}: (small, main, freq, ghost) = {got}")

    assert _sweep(TierIndex.reserve, _s3fifo_leased_small, lambda st: st[0].reserve(b"y", uuid.uuid4()), after) > 1
    return [f"uninterrupted: {ref}"] + wrong if wrong else []


def test_s3fifo_entries_held_by_the_small_walk_are_not_restored_into_main() -> None:
    """What: ``S3FIFO.victim`` walks small first (``self.walk = small``): k7 and x are leased, passed over into
    ``held_small``; small is then empty, so it walks main (``self.walk = main``) and evicts k0.  Its ``finally``
    puts ``held_small`` back into small one call at a time (``reversed``, ``move_to_end``); an interrupt at one of
    those returns leaves the rest of ``held_small`` out of both FIFOs, and ``TierIndex._repair(evicting=True)`` ->
    ``S3FIFO.restore`` puts them into ``self.walk`` -- main, a FIFO they were never taken from: a never-used block
    promoted to main (no ghost on its eviction, a different victim order) where the uninterrupted call leaves it at
    small's cold end.  ``walk`` says which FIFO was walked last, not which one the missing entry came from.
    Where: core/policy.py ``S3FIFO.victim`` (its ``finally``) and ``S3FIFO.restore``.
    Fix: let ``restore`` know where each missing entry came from, not only the FIFO walked last: e.g. keep the
    call's held lists on the policy (``self.held = (held_small, held_main)``, cleared when ``victim`` returns) and
    have ``restore`` put an entry found in one of them back into that list's FIFO (``walk`` only for the one entry
    popped and not placed yet)."""
    wrong = _broken_off_reserve_differs("move_to_end")
    assert not wrong, "S3-FIFO after a broken-off eviction, repaired and retried:\n  " + "\n  ".join(wrong)


def test_s3fifo_an_entry_taken_off_after_passed_over_ones_goes_back_behind_them() -> None:
    """What: the small walk passes over the leased k7 (``held_small``), then pops x (``popitem``); an interrupt at
    that return leaves x out.  ``victim``'s ``finally`` puts k7 back at small's cold end, and then
    ``S3FIFO.restore`` puts x at the cold end too -- *in front of* k7: small is [x, k7] where the uninterrupted
    call leaves [k7, x].  The next victim walk of small considers x before k7, an order no uninterrupted run gives
    (round 36's standard: the repaired order is the uninterrupted one).  The 'cold end it was taken from' is not
    where it was: the entries passed over before it sit in front of it.
    Where: core/policy.py ``S3FIFO.restore`` (``q.move_to_end(k, last=False)``) with ``victim``'s ``finally``.
    Fix: have ``victim`` put an entry it popped and has not yet placed into the held list (or a one-entry
    'in hand' slot) before any call, so the ``finally`` puts it back after the held ones in walk order; or let
    ``restore`` place it right behind the entries ``victim`` passed over (e.g. ``victim`` records the count of
    entries it put back, and ``restore`` inserts after them)."""
    wrong = _broken_off_reserve_differs("popitem")
    assert not wrong, "S3-FIFO after a broken-off eviction, repaired and retried:\n  " + "\n  ".join(wrong)


# ============================================================================ 2. readers: another key's record under this name
_TRANSPLANT_IN_CHILD = """
import sys, lmdb
path, dst, src, mapsize = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
env = lmdb.open(path, subdir=True, max_dbs=4, map_size=mapsize)
db = env.open_db(b"blocks", create=False)
with env.begin(write=True, db=db) as txn:
    txn.put(dst, bytes(txn.get(src)))   # another key's intact record, stored under this key's name
env.close()
print("copied", flush=True)
"""


@pytest.mark.parametrize("io", ["process", "thread"])
def test_another_keys_record_under_a_name_it_does_not_hash_to_is_counted_corrupt_and_removed(rig: Rig, io: str) -> None:
    """What: ``Readers._lookup``/``_verify`` check a record of another writer than expected with
    ``verify_entry(value, h.namespace, None, ...)``: the record's namespace is taken from the record itself and
    its key is not checked at all -- not even that the key hashes to the LMDB name it was found under.  So a
    record stored under a name that is not its key's (here: ks[1]'s intact record copied under ks[0]'s name by
    another process, the damage model of round 39's token flip) passes as 'intact, another write': a quiet
    "miss: superseded on disk", nothing counted, nothing removed.  The record stays (two records now name ks[1]'s
    slot; ks[0]'s slot is held by no record) until a reopen, whose recovery removes it (``removed_why``:
    ``lmdb_key_mismatch``, counted foreign) -- exactly the quiet-miss defect 871ff4c set out to close.  The same
    holds for a record of another *namespace* (``wrong_namespace`` for recovery, and for this very reader when
    the token matches: counted corrupt and removed), which this check accepts because it compares the record's
    namespace with itself.  The legitimate mismatches the commit names (the key written again; a long key's
    digest name shared with a short key) all have this tier's namespace and ``lmdb_key(h.key) == lmdb_key(op.key)``.
    Where: disk/readers.py ``Readers._lookup`` (inline) and ``Readers._verify`` (slot): ``h.namespace``/``None``.
    Fix: for a record of another writer verify ``verify_entry(value, self._ns, None, n, ...)`` and add the check
    ``lmdb_key(h.key) == lmdb_key(op.key)`` (CorruptEntry("wrong_key") otherwise), so only the two legitimate
    cases are a superseded miss; a record failing it is counted and removed by its own token as now."""
    damaged_record_is_counted_and_removed(rig, io, _TRANSPLANT_IN_CHILD,
                                          lambda ks: [lmdb_key(ks[0]).hex(), lmdb_key(ks[1]).hex()], "copied")
