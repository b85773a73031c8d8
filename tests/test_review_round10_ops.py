"""Round-10 adversarial review of the operator tools (tools/ops.py, tools/ops_cli.py, tools/archive.py).

What it proved wrong (each fixed; each test fails without its fix):

* export copied an entry's touch record into the archive's checksummed header without the plausibility
  check recovery applies to touch records, so a damaged touch record (harmless on the source: recovery
  drops it) became a verified sequence number past SEQ_LIMIT, and the imported entry was deleted as
  corrupt by the destination's first recovery.  Fixed: export applies recovery's rule
  (``disk.recovery.touch_limit``) and skips an entry recovery deletes;
* import published entries whose (verified) sequence number no writer reaches: the destination's writer
  resumed from it and every block written after the import was dropped at the next open, for good.  Fixed:
  such a frame is refused (exit 2);
* export of a tier whose meta records a block size past 64 bits died with a ``struct.error`` traceback
  instead of the documented one-line error and exit status 2.  Fixed: ``check_meta`` refuses it;
* verify reported 'ok' (exit 0, nothing for --repair to remove) an entry the TierManager's recovery deletes
  as corrupt (sequence number at or past SEQ_LIMIT with a valid checksum).  Fixed: reported ``bad_seq``.

Deterministic: seeded content (test_ops_common.content), tmp_path directories, no sleeps, no child
processes, no timing asserts.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from test_ops_common import NS, build_env, cli, content, keys, load_bytes, open_manager, raw_put, set_meta, store_keys
from test_review_ops2 import _archive, _entry
from tiered_kv.disk.format import lmdb_key
from tiered_kv.disk.recovery import SEQ_LIMIT


def _served(path: Path, ks: list[bytes]) -> dict[bytes, bool]:
    """Which of ``ks`` a TierManager opened on ``path`` serves with the right bytes."""
    mgr, kv = open_manager(path)
    try:
        return {k: load_bytes(mgr, kv, k) == content(k) for k in ks}
    finally:
        mgr.close()


# ============================================================================ findings
def test_a_damaged_touch_record_does_not_cost_the_entry_its_round_trip(tmp_path, capsys):
    """docs/operations.md: export writes "every valid entry"; import into a new PATH: "A TierManager opened
    on it afterwards (same namespace and block size) recovers the entries and serves them"; and export
    writes each entry's sequence as the newer of its write's and its last promote's (the touch record).

    A touch record carries no checksum.  Recovery (disk/recovery.py:133-140) treats one numbered at or past
    SEQ_CHECKED as damage and drops it: on the source, the entry stays and is served.  ``verify`` reports the
    source clean.  But export (tools/archive.py:424-428) takes the touch record as is, ``max(h.seq,
    touched)``, and ``inline_value`` re-signs the header with it: the damage now passes every checksum.  The
    destination's recovery (disk/recovery.py:90-93) deletes the entry as corrupt (``h.seq >= SEQ_LIMIT``),
    so the good block k0000 is lost in the round trip although import said "imported 4 of 4"."""
    src = build_env(tmp_path / "src", keys(4))
    raw_put(src, "touch", lmdb_key(b"k0000"), struct.pack("<Q", (1 << 64) - 1))   # a damaged recency record
    rc, out, err = cli(capsys, "verify", str(src), "--no-progress")
    assert rc == 0 and "4 ok, 0 corrupt, 0 orphaned" in out, (rc, out, err)
    arch = tmp_path / "warm.tkv"
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(arch), "--no-progress")
    assert rc == 0 and "exported 4 entries" in out, (rc, out, err)
    rc, out, err = cli(capsys, "import", str(tmp_path / "dst"), str(arch), "--no-progress")
    assert rc == 0 and "imported 4 of 4" in out, (rc, out, err)
    # the source itself serves every block (recovery drops the damaged touch record, not the entry) ...
    assert all(_served(src, keys(4)).values())
    # ... so must the imported copy
    served = _served(tmp_path / "dst", keys(4))
    assert all(served.values()), f"an entry lost in export/import: {served}"


def test_an_imported_sequence_number_near_the_limit_does_not_cost_every_later_write(tmp_path, capsys):
    """docs/architecture.md ("Durability"): a spill flushed durably survives a restart; disk/recovery.py's
    invariant: "the sequence number the writer resumes from is no damaged record's ... so the writer's later
    writes stay below SEQ_LIMIT (the next open keeps them)".  The guarantee rests on "no writer gets" to
    SEQ_CHECKED: only a checksummed header can carry such a number past recovery.

    Import verifies each frame with ``verify_entry`` only (tools/archive.py:288) and puts it as is
    (tools/archive.py:583): a frame whose checksum covers seq = SEQ_LIMIT - 1 -- what an export of a tier
    with a damaged touch record writes (see the test above) -- is imported.  The destination's recovery keeps
    it (disk/recovery.py:98: it verifies), the writer resumes from SEQ_LIMIT - 1 and numbers the next
    writes SEQ_LIMIT, SEQ_LIMIT + 1...; the next open deletes them as corrupt (disk/recovery.py:90-93).
    Two blocks stored and flushed (``flush()`` True) after the import are gone after a clean close and
    reopen -- and so is every block written after it, at every restart, for good.  Import should refuse
    such a frame (exit 2, naming it) or the numbers should be bounded."""
    arch = _archive(tmp_path / "a.tkv", [_entry(b"old0", seq=SEQ_LIMIT - 1)])
    rc, out, err = cli(capsys, "import", str(tmp_path / "dst"), str(arch), "--no-progress")
    if rc == 2:
        return   # refused as a bad archive: nothing was published (a fix)
    assert rc == 0, (rc, out, err)
    dst = tmp_path / "dst"
    mgr, kv = open_manager(dst)
    try:
        store_keys(mgr, kv, [b"new0", b"new1"])   # each stored, waited for and flushed durably
    finally:
        mgr.close()
    served = _served(dst, [b"new0", b"new1"])
    assert all(served.values()), f"blocks flushed after the import were lost at a clean restart: {served}"


def test_export_of_a_tier_whose_meta_block_size_is_past_64_bits_exits_2(tmp_path, capsys):
    """docs/operations.md: bad input (not a tiered_kv disk tier, a block-size mismatch...) is exit 2 with one
    line ``tiered-kv export: error: ...`` on stderr; inspect, verify, verify --repair and compact all cope
    with such a damaged meta record (exit 0/1/2).  ``check_meta`` (tools/ops.py:296-312) accepts any
    positive ``block_bytes``; export (tools/archive.py:394, ``pack_file_header``) packs it into the archive header's ``Q`` field:
    ``struct.error: argument out of range``, which neither ``ops_cli._run`` (tools/ops_cli.py:84-95: OpsError,
    lmdb.Error, OSError) nor ``cli.main`` (ValueError, OSError, ...) catches: a traceback."""
    src = build_env(tmp_path / "src", keys(2))
    set_meta(src, b"block_bytes", str(1 << 70).encode())
    out = tmp_path / "warm.tkv"
    try:
        rc, o, err = cli(capsys, "export", str(src), "--namespace", NS, str(out), "--no-progress")
    except struct.error as exc:
        raise AssertionError(f"export raised {exc!r} instead of exiting 2") from exc
    assert rc == 2 and err.startswith("tiered-kv export: error: "), (rc, o, err)
    assert not out.exists() and not list(tmp_path.glob("warm.tkv.partial-*"))


def test_verify_reports_an_entry_that_recovery_deletes_as_corrupt(tmp_path, capsys):
    """docs/operations.md: verify "lists corrupt and orphaned entries", exit 1 when any is found, and --repair
    is "for a clean verify"; recovery (disk/recovery.py:90-93) removes every entry numbered at or past
    SEQ_LIMIT as corrupt (``rep.corrupt``), checksum or not.  Such an entry with a valid checksum is what an
    import of the archive of test_a_damaged_touch_record... publishes, and what a writer of an earlier version
    resumed from a damaged number below SEQ_LIMIT wrote (tests/test_review_today.py).  ``_scan``
    (tools/ops.py:631-672) checks the header, checksum, LMDB key and tombstone only: it counts the entry ok,
    exit 0, and --repair removes nothing -- then the TierManager's open finds it corrupt and deletes it."""
    path = build_env(tmp_path / "disk", keys(2))
    raw_put(path, "blocks", lmdb_key(b"late"), _entry(b"late", seq=SEQ_LIMIT))   # checksum valid
    rc, out, err = cli(capsys, "verify", str(path), "--no-progress")
    mgr, _kv = open_manager(path)
    try:
        rec = mgr.disk.recovery
        held = mgr.lookup([b"late"]) == 1
    finally:
        mgr.close()
    assert held or (rc == 1 and "1 corrupt" in out), \
        (f"verify said {out.splitlines()[1:2]} (exit {rc}), the TierManager's recovery deleted the entry "
         f"as corrupt (recovery report {rec})")
