"""Review round 39: the disk read path (``disk/cached.py``, ``disk/readers.py``, the reads of ``disk/proc.py``, and
where the core applies PROMOTE reports).  Each test below failed on the code as reviewed (main at 9e2036b).
Both are fixed: ``start_reads`` puts ``passed`` back to what it was before the chunk when the child died; a slot
record of another writer than the one expected is read and verified against its own fields (a token mismatch is
also what a legitimate race looks like: the key invalidated and written again between the promote's start and its
lookup), a miss when intact, counted corrupt and removed by the token it carries when not
(``Readers._corrupt_record``).

Findings
--------

1. ``test_a_dead_childs_reads_never_make_the_handed_on_counter_go_down``: ``ProcessDiskStore.start_reads``
   (disk/proc.py) subtracts from ``CachedReads.passed`` every op in ``rest`` that has a record when the child
   died during the owner's page-cache reads. But ``CachedReads.read_chunk`` (disk/cached.py) returns the reads
   after the chunk in ``rest`` *without counting them* when nothing in the chunk was looked at (no record in
   the chunk, e.g. imported inline entries, or the slot file not open). So ``passed`` goes below what was
   ever added, and ``DiskTier.count_page_cache_reads`` adds a negative delta: the Prometheus counter
   ``tiered_kv_disk_page_cache_reads_total{outcome="handed_on"}`` goes *down* (``value.inc`` takes a
   negative amount silently). A counter that decreases reads as a reset to ``rate()``.

2. ``test_a_record_whose_token_was_damaged_while_running_is_counted_corrupt_and_removed``:
   ``Readers._lookup`` (disk/readers.py) compares the record's writer token with the one the owner expects
   *before* it verifies anything. A slot record whose token field was damaged while the tier runs is
   answered "miss: superseded on disk": not counted in ``tiered_kv_corrupt_blocks_total`` (so the
   corrupt-block alert stays silent), and no removal is queued. The owner forgets the key
   (``DiskTier.promote_reported``), so the record and its slot stay on disk outside the capacity count
   until the next open. The same damage found at open is a counted checksum failure and is removed
   (tests/test_disk_integrity.py, ``_READ_TIME["token"]``).

Run: ``PYTHONPATH=. python -m pytest -q tests/test_review_round39_reads.py -p no:cacheprovider``
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tiered_kv.disk.format import NO_WHERE, lmdb_key

from disk_helpers import (PYTHON, Rig, child_env, disk_only_keys, drain, fill, keys, load_into, make_kv, metric,  # noqa: F401
                          metric_sum, raw_keys, rig, row_is, store_seq)

pytestmark = pytest.mark.timeout(60)

PC = "tiered_kv_disk_page_cache_reads_total"


# ------------------------------------------------------------------------------------------------ finding 1
def test_a_dead_childs_reads_never_make_the_handed_on_counter_go_down(rig: Rig) -> None:
    """Finding 1. What: a Prometheus counter goes down.
    Where: disk/proc.py ``ProcessDiskStore.start_reads`` (the ``if self._dead:`` branch after the page-cache reads)
    together with disk/cached.py ``CachedReads.read_chunk``, which does not count the reads after a chunk that had
    nothing to look at (no record in it: an imported inline entry, or the slot file not open) but still hands
    them back in ``rest``.
    Setup: three reads, one per chunk (``chunk_ops = 1``, as the other chunk tests set it). The first key's
    record is not known to the owner (``NO_WHERE``, what an imported inline entry or a store that does not tell
    leaves). The child dies while the owner is in its page-cache pass, forced like
    ``test_the_disk_process_dying_between_two_chunks_answers_each_held_read_once``. read_chunk returns all
    three in ``rest`` and counts none. start_reads then subtracts the two that have a record: ``passed == -2``,
    and the ``handed_on`` counter drops by 2.
    Fix: take back only what this pass counted. Note ``before = cached.passed`` ahead of ``read_chunk``; on a
    death set ``cached.passed = before`` (every read not served was answered by the death). Or make
    ``read_chunk`` return how many of ``rest`` it counted."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    store = mgr.disk
    cached = store.cached
    cached.chunk_ops = 1
    mgr._core.dindex.ready(ks[0]).where = NO_WHERE   # the owner does not know this record (an imported entry's state)
    mgr.poll()
    before = metric(mgr, PC, outcome="handed_on")
    real = cached.read

    def die_then_read(ops, until=None):  # type: ignore[no-untyped-def]
        store.kill_for_test()
        store._receiver.join(30)   # its receiver answered every op it had (a join, no sleep)
        assert store.dead and store.down
        return real(ops, until)

    cached.read = die_then_read
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    mgr.wait(jobs, timeout=30)
    assert [j.state.name for j in jobs] == ["FAILED"] * 3   # answered by the death
    mgr.poll()
    assert cached.passed >= 0, f"CachedReads.passed went negative: {cached.passed}"
    after = metric(mgr, PC, outcome="handed_on")
    assert after >= before, f"tiered_kv_disk_page_cache_reads_total{{outcome='handed_on'}} went down: {before} -> {after}"


# ------------------------------------------------------------------------------------------------ finding 2
_FLIP_TOKEN_IN_CHILD = """
import sys, lmdb
path, key, mapsize = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
env = lmdb.open(path, subdir=True, max_dbs=4, map_size=mapsize)
db = env.open_db(b"blocks", create=False)
with env.begin(write=True, db=db) as txn:
    v = bytearray(txn.get(key))
    v[30] ^= 0x5A            # a byte of the writer token (header bytes 28..43), which the checksum covers
    txn.put(key, bytes(v))
env.close()
print("flipped", flush=True)
"""


@pytest.mark.parametrize("io", ["process", "thread"])
def test_a_record_whose_token_was_damaged_while_running_is_counted_corrupt_and_removed(rig: Rig, io: str) -> None:
    """Finding 2. What: the token field of a slot entry's record is damaged while the tier runs (another
    process writes data.mdb, as ``test_entry_corrupted_by_another_process_while_running_is_a_miss`` damages the
    slot file). The disk reader answers "miss: superseded on disk". Nothing is counted corrupt, no
    ``Delete(found_corrupt=True)`` is queued, and the owner forgets the key, so the damaged record and its slot
    stay on disk. The same byte flipped before open is a counted checksum failure, removed
    (test_disk_integrity.py ``_READ_TIME["token"]``). Design: "A read that fails verification is a miss, the
    entry is removed and counted."
    Where: disk/readers.py ``Readers._lookup`` (``if h.token != op.expect: return ... "miss: superseded on disk"``,
    before any check of the record). The owner never writes a key again while its entry is READY on disk, so
    for a slot record a token mismatch is no legitimate supersede.
    Fix: on a token mismatch, read the slot and verify the record against its own fields (``verify_entry``
    with the record's token). When that fails, answer ``CORRUPT`` (counted, ``on_corrupt("checksum")``) and
    queue a removal that matches the record's own token or the unparseable/corrupt rule
    (``delete_if_token`` ignores the expected token when ``found_corrupt``, trusting no slot number).
    Otherwise answer superseded as now."""
    damaged_record_is_counted_and_removed(rig, io, _FLIP_TOKEN_IN_CHILD, lambda ks: [lmdb_key(ks[0]).hex()], "flipped")


def damaged_record_is_counted_and_removed(rig: Rig, io: str, script: str, args: Any, done: str) -> None:
    """ks[0] stored, only on disk; ``script`` (a child process, given the tier's path, ``args(ks)`` and the map
    size) damages its index record while the tier runs and prints ``done``; the load of ks[0] must then fail,
    serve nothing, be counted corrupt once, and the record be gone after close."""
    kv = make_kv(8)
    # the disk readers' answer: a blocked wait() would serve the bytes itself (its own record verifies them)
    mgr = rig.open(kv, host_slots=2, disk_read_cached_in_wait=False, disk_io=io)
    ks = keys(3)
    store_seq(mgr, kv, ks)   # ks[0] (and ks[1]) only on disk now
    assert mgr.host_bytes(ks[0]) is None and mgr.lookup([ks[0]]) == 1
    r = subprocess.run([PYTHON, "-c", script, str(rig.path), *args(ks), str(mgr.disk.map_size)],
                       capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 0 and done in r.stdout, r.stderr
    fill(kv, 5, b"sentinel")
    job, comp = load_into(mgr, kv, ks[0], 5)
    assert job is not None and comp is not None and not comp.ok   # never served: right
    assert row_is(kv, 5, b"sentinel")
    drain(mgr)
    assert mgr.flush(timeout=30) is True
    assert mgr.lookup([ks[0]]) == 0
    corrupt = metric_sum(mgr, "tiered_kv_corrupt_blocks_total")
    error = comp.error
    rig.close(mgr)
    left = raw_keys(rig.path)
    assert corrupt == 1, f"a damaged record was answered {error!r} and not counted corrupt"
    assert ks[0] not in left, f"the damaged record (answered {error!r}) was left on disk with its slot"
