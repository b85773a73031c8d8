"""Regressions: six bugs an adversarial review of the operator commands and the open/recovery path
found (2026-12-01); each test failed before its fix, and its docstring tells the bug as it was.
Deterministic: seeded content, tmp_path directories, a child process driven line by line where
"beside a live TierManager" is needed, no sleeps."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

from test_ops_common import (NS, PYTHON, REPO, ROW, build_env, cli, content, keys, load_bytes, open_manager, raw,
                             raw_put, snapshot, token_of)
from tiered_kv.disk.format import SLOTS_NAME, lmdb_key, parse_header
from tiered_kv.tools.archive import FRAME_OVERHEAD, _FILE_HDR

BIG_ROW = 64 << 10      # a 64 KiB block (a realistic KV block size is far larger)


def _child_env() -> dict[str, str]:
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + ((os.pathsep + env["PYTHONPATH"]) if env.get("PYTHONPATH") else "")
    return env


def _archive_values(path: Path) -> dict[bytes, bytes]:
    """Block key -> the stored value each frame of the archive at ``path`` carries (frames in order)."""
    data = path.read_bytes()
    _m, _v, _f, _fl, _bb, _cr, ns_len, info_len = _FILE_HDR.unpack_from(data, 0)
    off = _FILE_HDR.size + ns_len + info_len + 8
    out: dict[bytes, bytes] = {}
    while data[off:off + 4] == b"TKVF":
        (length,) = struct.unpack_from("<I", data, off + 12)
        value = data[off + FRAME_OVERHEAD:off + FRAME_OVERHEAD + length]
        out[parse_header(value).key] = value
        off += FRAME_OVERHEAD + length
    assert data[off:off + 4] == b"TKVE", "the archive does not end with its trailer"
    return out


def _serves(path: Path, row: int) -> tuple[dict[bytes, Optional[bytes]], Any]:
    """Open a TierManager on ``path``: (key -> bytes it loads, or None on a miss) for the keys of this
    module's environments, and its recovery report."""
    mgr, kv = open_manager(path, row=row)
    try:
        assert mgr.disk is not None, "the disk tier was not opened"
        got = {k: load_bytes(mgr, kv, k) for k in keys(3) + keys(3, "n")}
        return got, mgr.disk.recovery
    finally:
        mgr.close()


def _child(script: str, *args: str, ready: str) -> "subprocess.Popen[str]":
    """A child Python process running ``script`` with ``args``, once it has printed ``ready``."""
    proc = subprocess.Popen([PYTHON, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_child_env())
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == ready, proc.stderr.read() if proc.stderr else ""
    return proc


# ============================================================================ 1. a damaged slot number
@pytest.mark.parametrize("argv", [["verify"], ["verify", "--repair"], ["export"], ["import"]])
def test_a_bit_flipped_high_slot_number_is_reported_not_a_traceback(argv, tmp_path, capsys):
    """An index record whose slot number has a high bit flipped (still < 2**48, so parse_header
    accepts it) makes slot * slot_bytes exceed off_t for blocks > 32 KiB: SlotReader.payload's
    os.pread raises OverflowError, which no command catches (traceback, no exit status), so
    verify cannot even --repair it.  A TierManager's recovery drops the same entry (past the
    end of the slot file): the tools must report it as corrupt (truncated) too."""
    path = build_env(tmp_path / "disk", keys(3), row=BIG_ROW)
    lk = lmdb_key(b"k0001")
    v = bytearray(raw(path, inline=False)[lk])
    struct.pack_into("<Q", v, len(v) - 8, (1 << 48) - 1)
    raw_put(path, "blocks", lk, bytes(v))
    raw_put(path, "touch", lk, struct.pack("<Q", 99))          # its recency record (goes with the entry)
    good = {k: raw(path, inline=False)[lmdb_key(k)] for k in (b"k0000", b"k0002")}   # index records as stored
    good_inline = {k: raw(path)[lmdb_key(k)] for k in good}    # ... and as self-contained entries
    src = None
    if argv[0] == "export":
        args = ["export", str(path), "--namespace", NS, str(tmp_path / "a.tkv")]
    elif argv[0] == "import":
        src = build_env(tmp_path / "src", keys(3, "n") + [b"k0001"], row=BIG_ROW)
        rc, _, err = cli(capsys, "export", str(src), "--namespace", NS, str(tmp_path / "a.tkv"))
        assert rc == 0, err
        args = ["import", str(path), str(tmp_path / "a.tkv")]
    else:
        args = [argv[0], str(path), *argv[1:]]
    before = snapshot(path)
    rc, out, err = cli(capsys, *args, "--no-progress")      # raises OverflowError on the current code
    after = raw(path, inline=False)
    if argv[0] in ("verify", "export") and "--repair" not in argv:      # read-only: nothing changed
        assert snapshot(path) == before, "a read-only command changed the disk tier"
    if argv == ["verify"]:
        assert rc == 1 and "truncated" in out, (rc, out, err)
        assert "checked 3 entries" in out and "2 ok, 1 corrupt, 0 orphaned" in out, out
        assert [ln.split()[:3] for ln in out.splitlines() if ln.startswith("  corrupt")] == \
            [["corrupt", "truncated", "key=b'k0001'"]], out
    elif argv == ["verify", "--repair"]:
        assert rc == 0, (rc, out, err)
        assert "repaired: removed 1 entries; check after repair: 2 ok, 0 corrupt, 0 orphaned" in out, out
        # exactly the damaged entry (and its touch record) is gone; the good ones are untouched
        assert set(after) == {lmdb_key(k) for k in good}
        assert {k: after[lmdb_key(k)] for k in good} == good
        assert raw(path, "touch") == {}
    elif argv[0] == "export":
        assert rc == 0 and "exported 2 entries" in out, (rc, out, err)
        assert _archive_values(tmp_path / "a.tkv") == good_inline, "the archive does not hold the good entries as stored"
    else:
        assert src is not None
        assert rc == 0, (rc, out, err)
        assert "imported 3 of 4 entries" in out and "replaced corrupt local entries: 1;" in out, out
        assert "already present (same key and writer): 0; kept local entry of another writer: 0;" in out, out
        frames = _archive_values(tmp_path / "a.tkv")
        imported = [b"n0000", b"n0001", b"n0002", b"k0001"]
        assert sorted(frames) == sorted(imported)
        assert frames == {k: raw(src)[lmdb_key(k)] for k in imported}   # the source's entries, as stored
        # the archive's entries are stored byte for byte (inline), the damaged local entry replaced by
        # the archive's k0001 (the source's writer token), the good local entries untouched
        assert set(after) == {lmdb_key(k) for k in imported + list(good)}
        assert {k: after[lmdb_key(k)] for k in imported} == frames
        assert {k: after[lmdb_key(k)] for k in good} == good
        assert token_of(path, b"k0001") == token_of(src, b"k0001")
        assert raw(path, "touch") == {}, "the replaced entry's recency record was kept"
    # what a TierManager opening the path afterwards serves: the right bytes or a miss, never wrong bytes
    served, recovery = _serves(path, BIG_ROW)
    expect = {k: content(k, BIG_ROW) for k in good}
    if argv[0] == "import":
        expect.update({k: content(k, BIG_ROW) for k in (b"n0000", b"n0001", b"n0002", b"k0001")})
    assert served == {k: expect.get(k) for k in served}
    # the damaged entry is still there for recovery to drop only where nothing removed it
    assert (recovery.entries, recovery.corrupt) == (len(expect), 1 if argv in (["verify"], ["export"]) else 0)


# ============================================================================ 2. a damaged touch record
def test_a_damaged_touch_record_does_not_make_the_tiermanager_raise(tmp_path):
    """Recovery unpacks every touch record with struct '<Q' and lets struct.error escape
    DiskStore(): TierManager() raises instead of recovering (invariant 11: an unopenable disk tier
    leaves the manager host-only; here the tier is perfectly usable, one recency record is bad)."""
    path = build_env(tmp_path / "disk", keys(3))
    raw_put(path, "touch", lmdb_key(b"k0001"), b"\x01\x02\x03")       # 3 bytes, not 8
    mgr, kv = open_manager(path)                                         # struct.error on the current code
    try:
        assert mgr.disk is not None, "the disk tier was not opened"
        for k in keys(3):
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


# ============================================================================ 3. import over an orphaned local entry
def test_import_replaces_a_local_entry_that_recovery_will_purge(tmp_path, capsys):
    """A local entry written under a tombstoned token (orphaned: the next open purges it) is
    treated by import as a valid entry of another writer: the archive's good entry for that key
    is dropped and counted as 'kept local entry of another writer', and after the next open the
    key is gone.  It must be replaced, like a local entry that fails verification."""
    src = build_env(tmp_path / "src", keys(3))
    dst = build_env(tmp_path / "dst", keys(3))                # same keys, other writer tokens
    rc, _, err = cli(capsys, "export", str(src), "--namespace", NS, str(tmp_path / "a.tkv"))
    assert rc == 0, err
    orphan = token_of(dst, b"k0001")
    raw_put(dst, "tombs", orphan.bytes, b"k0001")
    local = {k: raw(dst, inline=False)[lmdb_key(k)] for k in (b"k0000", b"k0002")}
    rc, out, err = cli(capsys, "import", str(dst), str(tmp_path / "a.tkv"), "--json", "--no-progress")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["kept_existing"] == 2, rep                     # 3 on the current code
    assert {k: rep[k] for k in ("frames", "imported", "already_present", "kept_existing", "replaced_corrupt",
                                "skipped_tombstoned")} == \
        {"frames": 3, "imported": 0, "already_present": 0, "kept_existing": 2, "replaced_corrupt": 1,
         "skipped_tombstoned": 0}, rep
    after = raw(dst, inline=False)
    assert set(after) == {lmdb_key(k) for k in keys(3)}
    # k0001 is now the archive's entry byte for byte (the source's writer token, stored inline), the
    # other two keep their local entries untouched
    assert after[lmdb_key(b"k0001")] == raw(src)[lmdb_key(b"k0001")]
    assert token_of(dst, b"k0001") == token_of(src, b"k0001") != orphan
    assert {k: after[lmdb_key(k)] for k in local} == local
    mgr, kv = open_manager(dst)
    try:
        rec = mgr.disk.recovery                               # the tomb guards nothing any more
        assert (rec.entries, rec.purged, rec.tombs_dropped, rec.corrupt) == (3, 0, 1, 0), rec
        for k in keys(3):
            assert load_bytes(mgr, kv, k) == content(k), f"{k!r}: the imported entry was lost"
    finally:
        mgr.close()


# ============================================================================ 4. import racing a TierManager start
@pytest.mark.parametrize("exists", [False, True])
def test_import_refused_by_a_tiermanager_started_meanwhile_leaves_its_files_alone(exists, tmp_path, capsys,
                                                                                   monkeypatch):
    """import into a new PATH takes the TierManager lock only after pass 1 and after creating the
    directory; when a TierManager took the path in between, hold_path refuses (exit 3, correct),
    but the cleanup (created/made) runs for that refusal too and deletes the live TierManager's
    directory (or its data.mdb, lock.mdb and tiered_kv.lock).  A refused command changes nothing."""
    import tiered_kv.tools.archive as archive_mod
    from tiered_kv.tools.archive import export_archive
    src = build_env(tmp_path / "src", keys(2))
    export_archive(src, NS, tmp_path / "a.tkv")
    path = tmp_path / "new" / "disk"
    if exists:
        path.mkdir(parents=True)
    started = []
    real_hold = archive_mod.hold_path

    def hold_path(p):                     # the serving process starts on PATH just before the lock
        mgr, kv = open_manager(Path(p))
        started.append((mgr, kv))
        return real_hold(p)

    monkeypatch.setattr(archive_mod, "hold_path", hold_path)
    try:
        rc, out, err = cli(capsys, "import", str(path), str(tmp_path / "a.tkv"), "--no-progress")
        assert rc == 3, (rc, out, err)
        mgr, kv = started[0]
        for name in ("data.mdb", "lock.mdb", "tiered_kv.lock", SLOTS_NAME):
            assert (path / name).exists(), f"the refused import deleted the live TierManager's {name}"
    finally:
        for mgr, _kv in started:
            mgr.close()


# ============================================================================ 5. verify beside a live writer
LIVE = r"""
import sys, hashlib, torch
from prometheus_client import CollectorRegistry
from tiered_kv import TierManager, TieredKVConfig
path, ns, row = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = torch.zeros((8, row), dtype=torch.uint8)
cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=4 * row, disk_path=path, disk_capacity_bytes=64 * row,
                     durability="sync")
mgr = TierManager(cfg, kv, registry=CollectorRegistry())
def put(k, r):
    kv[r].copy_(torch.frombuffer(bytearray(hashlib.shake_128(b"blk:" + k).digest(row)), dtype=torch.uint8))
    job = mgr.store(k, r)
    mgr.wait([job], timeout=30)
    assert mgr.flush(timeout=30)
for i in range(8):
    put(b"k%04d" % i, i)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "churn":      # drop k0000..k0003, their slots are reused by n0000..n0003
        for i in range(4):
            mgr.invalidate(b"k%04d" % i)
        assert mgr.flush(timeout=30)
        for i in range(4):
            put(b"n%04d" % i, i)
        print("done", flush=True)
mgr.close()
"""


def test_read_only_verify_beside_a_live_tiermanager_does_not_report_reused_slots_as_corrupt(tmp_path):
    """verify (read-only) is documented as safe beside a live TierManager and "a consistent
    snapshot": but only the LMDB index is a snapshot, the slot file is not.  An entry dropped by
    the live writer after verify's read transaction began has its slot reused; verify reads the
    new bytes, reports a valid entry as corrupt (checksum) and exits 1, telling the operator to
    stop the TierManager and --repair.  The DiskStore's own reader re-reads the index before
    blaming the bytes ("superseded"); verify (and export, which then counts 'skipped corrupt')
    must do the same."""
    from tiered_kv.tools.ops import verify
    path = tmp_path / "disk"
    proc = _child(LIVE, str(path), NS, str(ROW), ready="ready")
    try:
        assert proc.stdout is not None and proc.stdin is not None
        churned = []

        def progress(done, total):   # called inside verify's read transaction, before the first check
            if not churned:
                proc.stdin.write("churn\n")
                proc.stdin.flush()
                churned.append(proc.stdout.readline().strip())

        rep = verify(path, progress=progress)
        assert churned == ["done"]
        assert rep.checked == 8
        assert rep.corrupt == [], [(p.reason, p.key) for p in rep.corrupt]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)


# ============================================================================ 6. a killed read-only command beside a live writer
CHURN = r"""
import sys, os, hashlib, torch
from prometheus_client import CollectorRegistry
from tiered_kv import TierManager, TieredKVConfig
path, ns, row = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = torch.zeros((8, row), dtype=torch.uint8)
cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=4 * row, disk_path=path, disk_capacity_bytes=64 * row)
mgr = TierManager(cfg, kv, registry=CollectorRegistry())
n = 0
def put(k, r):                       # replace k's entry: each round commits a delete and a spill
    kv[r].copy_(torch.frombuffer(bytearray(hashlib.shake_128(b"blk:%s:%d" % (k, n)).digest(row)), dtype=torch.uint8))
    mgr.invalidate(k)
    job = mgr.store(k, r)
    assert job is not None
    mgr.wait([job], timeout=30)
    assert mgr.flush(timeout=30)
print("ready", flush=True)
for line in sys.stdin:
    for i in range(int(line)):
        n += 1
        put(b"k%04d" % (i % 8), i % 8)
    print(os.path.getsize(os.path.join(path, "data.mdb")), flush=True)
mgr.close()
"""

KILLED_VERIFY = r"""
import sys
from tiered_kv.tools.ops import verify
def progress(done, total):           # inside verify's read transaction: wait here to be killed
    print("in txn", flush=True)
    sys.stdin.readline()
verify(sys.argv[1], progress=progress)
"""


def test_a_killed_read_only_verify_does_not_pin_the_live_writers_pages_forever(tmp_path):
    """verify/export/inspect are documented as safe beside a live TierManager: "a long read
    transaction keeps a busy writer from reusing freed pages *until it ends*".  One that is
    SIGKILLed (OOM killer, kill -9, a container stop) never ends for LMDB: its reader-table slot
    keeps its snapshot's txnid, nothing in tiered_kv ever calls reader_check(), and the live
    writer can reuse no freed page again: data.mdb grows with every commit (here 48 KiB -> MiBs
    within 200 spills) until the TierManager restarts (or the disk fills)."""
    path = tmp_path / "disk"
    w = _child(CHURN, str(path), NS, str(ROW), ready="ready")
    try:
        assert w.stdout is not None and w.stdin is not None

        def churn(n: int) -> int:
            w.stdin.write(f"{n}\n")
            w.stdin.flush()
            return int(w.stdout.readline())

        churn(50)
        base = churn(100)                               # steady state: LMDB reuses its freed pages
        r = _child(KILLED_VERIFY, str(path), ready="in txn")
        r.kill()
        r.wait(timeout=30)
        after = churn(200)
        assert after < base + (512 << 10), f"data.mdb grew from {base} to {after} bytes after a killed verify"
    finally:
        if w.stdin is not None:
            w.stdin.close()
        w.wait(timeout=60)
