"""Adversarial review (round 11) of today's fixes: 30929fa and 6bde078 (``SlabScheduler._told``: a named
request's keys told HIT are counted once until it is scheduled or finished; prepare_load/prepare_store check
their keys before ``request_scheduled``), bdcdd52 (API boundary: mover_factory result, ``from_env``
arguments, non-UTF-8 ``disk_path``, nested tensors) and 67082a8 (operator tools: export's touch limit,
import's ``SEQ_CHECKED`` refusal, verify's ``bad_seq``, check_meta's 64-bit block size).

What it proved wrong (each fixed; each test fails without its fix):

1. ``test_a_told_hit_block_read_back_from_disk_is_not_two_hits_for_one_lookup_key``: a block a named request
   was told is a HIT (one lookup key and one host hit), evicted to disk before the request is asked again,
   is not counted a lookup key at the re-ask (``_was_told``) but is counted a disk hit when its read-back
   lands: one key, two hits -- the documented hit rate (hits / keys) goes past 1.  Fixed: a key told HIT and not HIT now leaves ``_told``: its re-ask is a
   new lookup key.
2. ``test_an_export_of_a_tier_recovery_and_verify_accept_is_imported``: export writes every entry verify
   calls ok and recovery serves, including one numbered in [SEQ_CHECKED, SEQ_LIMIT) (a writer that resumed
   past SEQ_CHECKED numbers every later write and touch that high); import refuses the whole archive (exit 2):
   the export/import round trip loses every block of such a tier.  Fixed: import carries such a number
   just below SEQ_CHECKED (re-signed) instead of refusing; only SEQ_LIMIT or more is refused.
3. ``test_export_signs_the_touch_record_recovery_orders_the_lru_by``: export drops a touch record numbered in
   [SEQ_CHECKED, SEQ_LIMIT) by the entry's own sequence number (``touch_limit(h.seq)``), where recovery keeps it
   by the highest verified entry's (``touch_limit(seq)``): the archive orders a block its source's LRU holds
   newest as one of the oldest.  Fixed: export measures ``touch_limit`` against the highest entry recovery keeps
   (``archive._top_seq``).
4. ``test_import_replaces_a_local_entry_recovery_deletes``: import keeps a local entry of the same key whose
   checksum verifies but whose sequence number is at or past SEQ_LIMIT (what verify now reports ``bad_seq`` and
   recovery deletes) as "kept local entry of another writer", and skips the archive's good copy: the next open
   deletes the local entry and the block is gone.  Fixed: such a local entry is replaced.

Checked and found right (no test): from_env accepts os.environ, an explicit os.environ, a MappingProxyType, a
ChainMap, a UserDict; check_disk_path accepts PathLike and non-ASCII UTF-8 paths; every Mover of the library and
of the tests subclasses ``movers.base.Mover`` (the type MoverFactory names; docs/architecture.md calls it the base
class the owner calls); a dense tensor passes ``check_device_blocks`` as before; in prepare_load/prepare_store
nothing after the key checks refuses, so a refused call changes nothing; ``reset()`` and ``request_finished``
drop ``_told``, and prepare_load/prepare_store named with a request only in ``_told`` drop it; ``_told`` touches
neither ``_guard`` nor the KV events; a request re-asked after preemption was scheduled in between (its
``_told`` gone), so it counts again; verify's ``bad_seq`` and --repair delete exactly what recovery deletes
(seq >= SEQ_LIMIT).  tests/test_scheduler_counts_machine.py still passes, but its lookups name no request: it
does not exercise ``_told`` at all.

Deterministic: tmp_path, no sleeps for ordering (the read-backs are waited for with wait_promotes).
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from test_ops_common import NS, ROW, build_env, cli, content, keys, load_bytes, open_manager, raw_put
from test_review_ops2 import _entry
from test_review_round6 import H1
from test_review_round8 import _stores
from test_review_scheduler4 import _ask
from test_review_scheduler_logic import _disk_only
from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    metric, rig, store_ready, wait_promotes,
)
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.disk import recovery
from tiered_kv.disk import store as disk_store
from tiered_kv.disk.format import lmdb_key, parse_header
from tiered_kv.disk.recovery import SEQ_CHECKED, SEQ_LIMIT
from tiered_kv.integrations.scheduler import Lookup
from tiered_kv.tools import archive as A

pytestmark = pytest.mark.timeout(60)

DK = b"dk-on-the-disk"


def _counts(tiers):
    """(lookup keys, host hits, disk hits) of ``tiers``' metrics."""
    m = tiers.metrics
    return (metric(m, "tiered_kv_lookup_keys_total"),
            metric(m, "tiered_kv_lookup_hits_total", tier="host"),
            metric(m, "tiered_kv_lookup_hits_total", tier="disk"))


# =========================================================================== 1. _told: one key, two hits
def test_a_told_hit_block_read_back_from_disk_is_not_two_hits_for_one_lookup_key(rig):
    """docs/observability.md: ``tiered_kv_lookup_keys_total`` / ``tiered_kv_lookup_hits_total`` are "prefix
    lookups and hits per tier (each hit counted once ...)", and the dashboard's "prefix hit rate by tier (hits /
    keys)"; lookup's docstring: "its hit is counted when it is served, a disk hit if it is the read-back the
    request waited on".

    Request r is told H1 is a HIT (6bde078: one lookup key and one host hit, H1 remembered in ``_told``) and is
    not scheduled (vLLM ran out of budget or KV blocks, or skipped it: it stays waiting).  It waits on no block,
    so nothing keeps H1 past the next step's lookups (docs/vllm.md's known limit, tests/test_review_round9.py
    #1): later steps' stores evict H1 from the host slab; the disk tier still holds it.  When vLLM asks r again,
    H1 is PENDING (a read-back): ``lookup`` (integrations/scheduler.py:223) counts no lookup key because r was
    told H1 before (``_was_told``); when the read-back lands, r's ask is a HIT of the read-back it waited on and
    ``_hit`` (scheduler.py:279-281) counts a ``disk`` hit -- its first host hit is never taken back.  One block
    of one request, served once (r's load), is 1 lookup key and 2 hits.  Before 6bde078 it was 2 keys and 2
    hits.  A remote fetch instead of the read-back (RETRY, then ``_waited``'s host/remote hit at
    scheduler.py:282-284) does the same."""
    tiers = _disk_only(rig, [DK], num_slots=3, host_evict_ahead_blocks=0)
    store_ready(tiers, [H1])
    tiers.tick()
    before = _counts(tiers)
    # step N: r's prefix [H1]: a HIT; vLLM does not schedule r this step (it stays in the waiting queue)
    assert _ask(tiers, "r", [H1]) == ([H1], False)
    tiers.tick()
    # step N+1: another request's lookup takes the step (r is not asked); the step ends
    assert _ask(tiers, "q", [b"q-new-block"]) == ([], False)
    tiers.tick()
    # decode steps of the running requests: their new blocks take the host slots; H1 stays on disk only
    for i in range(4):
        assert tiers.flush(timeout=30)     # the spills done: the slots they read are evictable
        _stores(tiers, 1, tag=b"decode%d" % i)
    assert tiers.state_of(H1) == (None, "ready"), tiers.state_of(H1)
    # r is asked again: H1 is read back (deferred), then a HIT once it landed; r is scheduled and loads it
    assert tiers.lookup(H1, request="r") is Lookup.PENDING
    wait_promotes(tiers)
    assert tiers.lookup(H1, request="r") is Lookup.HIT
    tiers.prepare_load([H1], request="r")
    keys_, host, disk = (a - b for a, b in zip(_counts(tiers), before))
    r_keys = keys_ - 1                      # q's miss is one key
    assert host + disk <= r_keys, (
        f"r's one block H1, served once: {r_keys:.0f} lookup key(s), {host:.0f} host hit(s), {disk:.0f} disk "
        f"hit(s): hits exceed lookup keys (hit rate {(host + disk) / r_keys:.1f})")


# =========================================================================== 2. export/import round trip
def test_an_export_of_a_tier_recovery_and_verify_accept_is_imported(tmp_path, capsys):
    """docs/operations.md: export "writes every valid entry to a portable archive"; "A TierManager opened on
    [an imported PATH] afterwards ... recovers the entries and serves them"; import refuses (exit 2, nothing
    changed) "an entry numbered past what any writer reaches (SEQ_CHECKED ...)".

    Recovery (disk/recovery.py:104-132) keeps and serves an entry numbered in [SEQ_CHECKED, SEQ_LIMIT) whose
    checksum verifies (what a writer that resumed from a damaged number, tests/test_review_today.py, wrote),
    and ``touch_limit`` (recovery.py:49-54) explicitly allows "a writer resumed from it" to number its later
    touches and writes past SEQ_CHECKED: the TierManager opened here does (its promotes' touch records).
    ``verify`` calls the tier clean (ops.py:670 checks SEQ_LIMIT only), export (archive.py:418: SEQ_LIMIT
    only) exports every entry and exits 0 -- and import (archive.py:294: SEQ_CHECKED) refuses the archive
    outright, so even the three ordinary blocks of the tier never arrive.  The two tools disagree on which
    entries are valid: export should skip (count) or renumber such entries, or import renumber the frames below
    SEQ_CHECKED keeping their order (a sequence number in an archive is recency only)."""
    src = build_env(tmp_path / "src", keys(3))
    raw_put(src, "blocks", lmdb_key(b"late"), _entry(b"late", seq=SEQ_CHECKED))   # checksum valid
    rc, out, err = cli(capsys, "verify", str(src), "--no-progress")
    assert rc == 0 and "4 ok, 0 corrupt, 0 orphaned" in out, (rc, out, err)
    mgr, kv = open_manager(src)               # recovery keeps it; the writer resumes from SEQ_CHECKED
    try:
        served = {k: load_bytes(mgr, kv, k) == content(k) for k in keys(3) + [b"late"]}
    finally:
        mgr.close()
    assert all(served.values()), served       # a good tier: every block served
    arch = tmp_path / "warm.tkv"
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(arch), "--no-progress")
    assert rc == 0 and "exported 4 entries" in out, (rc, out, err)
    rc, out, err = cli(capsys, "import", str(tmp_path / "dst"), str(arch), "--no-progress")
    assert rc == 0, f"import of what export wrote from a clean, served tier: exit {rc}: {err.strip()}"
    mgr, kv = open_manager(tmp_path / "dst")
    try:
        got = {k: load_bytes(mgr, kv, k) == content(k) for k in keys(3)}
    finally:
        mgr.close()
    assert all(got.values()), got


# =========================================================================== 3. export's touch limit
def _archive_seqs(path):
    """{key: sequence number} of each frame of the archive at ``path`` (tools/archive.py's layout)."""
    data = path.read_bytes()
    _m, _v, _f, _fl, _bb, _cr, ns_len, info_len = A._FILE_HDR.unpack_from(data, 0)
    off = A._FILE_HDR.size + ns_len + info_len + A._SUM.size
    out = {}
    while data[off:off + 4] == A.FRAME_MAGIC:
        _magic, _index, length = A._FRAME.unpack_from(data, off)
        h = parse_header(data[off + A.FRAME_OVERHEAD:off + A.FRAME_OVERHEAD + length])
        out[h.key] = h.seq
        off += A.FRAME_OVERHEAD + length
    return out


def test_export_signs_the_touch_record_recovery_orders_the_lru_by(tmp_path, capsys, monkeypatch):
    """docs/operations.md: "Entries keep their recency on the source: export writes each entry's sequence as
    the newer of its write's and its last promote's (the touch record recovery orders the LRU by), inside the
    checksummed header"; 67082a8: export "applies recovery's rule (disk.recovery.touch_limit, shared)".

    The tier holds a verified entry numbered SEQ_CHECKED (what recovery keeps: disk/recovery.py:104-132), so a
    TierManager opened on it resumes from SEQ_CHECKED, and its promote of k0000 writes k0000's touch record
    SEQ_CHECKED + 1.  Recovery keeps that touch: its limit is ``touch_limit(seq)`` of the highest verified entry
    (SEQ_CHECKED), i.e. SEQ_LIMIT (recovery.py:141), and orders k0000 as the newest block.  Export computes
    ``touch_limit(h.seq)`` of k0000's own write (a small number): SEQ_CHECKED (tools/archive.py:430), drops the
    touch as damage, and signs k0000 with its old write number: the archive holds the block used last as
    older than every other.  Export needs the highest verified sequence number (a first pass, or the
    writer's resume point) to apply recovery's rule."""
    src = build_env(tmp_path / "src", keys(3))
    raw_put(src, "blocks", lmdb_key(b"late"), _entry(b"late", seq=SEQ_CHECKED))   # checksum valid
    mgr, kv = open_manager(src)               # recovery keeps it; the writer resumes from SEQ_CHECKED
    try:
        assert load_bytes(mgr, kv, b"k0000") == content(b"k0000")   # a promote: k0000 used last
    finally:
        mgr.close()
    # the source's own order: what recovery returns (oldest first) at the next open (in-process disk I/O)
    got = []

    def spy(*a, **kw):
        r = recovery.recover(*a, **kw)
        got.append([e.key for e in r[0]])
        return r
    monkeypatch.setattr(disk_store, "recover", spy)
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=4 * ROW, disk_path=src, disk_capacity_bytes=256 * ROW,
                         disk_io="thread")
    TierManager(cfg, torch.zeros((8, ROW), dtype=torch.uint8), registry=CollectorRegistry()).close()
    assert got and got[0][-1] == b"k0000", f"recovery's LRU order on the source (oldest first): {got}"
    arch = tmp_path / "warm.tkv"
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(arch), "--no-progress")
    assert rc == 0 and "exported 4 entries" in out, (rc, out, err)
    seqs = _archive_seqs(arch)
    assert seqs[b"k0000"] > max(s for k, s in seqs.items() if k != b"k0000"), (
        f"k0000, promoted last on the source (recovery orders it newest), is signed "
        f"{seqs[b'k0000']} in the archive; the others: "
        f"{ {k: s for k, s in seqs.items() if k != b'k0000'} }")


# =========================================================================== 4. import's check of a local entry
def test_import_replaces_a_local_entry_recovery_deletes(tmp_path, capsys):
    """docs/operations.md (import): "A key stored by another writer keeps the local entry (kept local entry); a
    local entry that fails verification is replaced"; verify (67082a8) reports an entry numbered at or past
    SEQ_LIMIT corrupt (``bad_seq``: "a sequence number past what any writer reaches, which recovery deletes").

    ``_import_pass`` (tools/archive.py:580-588) checks the local entry with ``verify_entry`` and the tombstones
    only, not the sequence number: the local ``x`` numbered SEQ_LIMIT (checksum valid) counts as "kept local
    entry of another writer" and the archive's good ``x`` is skipped.  The next TierManager open (recovery,
    disk/recovery.py:98-100) deletes the local entry as corrupt: the block the archive carried is lost.  It
    should be "replaced corrupt local entries", as verify's rule (and 67082a8's message) say."""
    src = build_env(tmp_path / "src", [b"x"])
    arch = tmp_path / "warm.tkv"
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(arch), "--no-progress")
    assert rc == 0 and "exported 1 entries" in out, (rc, out, err)
    dst = build_env(tmp_path / "dst", keys(2))
    raw_put(dst, "blocks", lmdb_key(b"x"), _entry(b"x", seq=SEQ_LIMIT))   # checksum valid, recovery deletes it
    rc, out, err = cli(capsys, "verify", str(dst), "--no-progress")
    assert rc == 1 and "1 corrupt" in out and "bad_seq" in out, (rc, out, err)
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 0, (rc, out, err)
    mgr, kv = open_manager(dst)
    try:
        served = load_bytes(mgr, kv, b"x") == content(b"x")
        rec = mgr.disk.recovery
    finally:
        mgr.close()
    assert served, (f"x, in the archive and locally only as an entry recovery deletes, is not served after the "
                    f"import ({out.strip().splitlines()[-1]!r}; recovery {rec})")
