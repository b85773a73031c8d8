"""Second adversarial review of the operator commands (tools/ops.py, ops_cli.py, archive.py).

What it proved wrong, each pinned by a test that failed before its fix: read-only verify and export
crashed (SIGSEGV) when a live writer had grown the map and an entry failed its check (the re-check's
transaction remapped under the scan's open one); a damaged last_recovery record (a huge number, deep
nesting) stopped inspect and verify; an export replaced a file that appeared at OUT while it ran; a
failed import into a new path could remove a tier a TierManager made there meanwhile; verify --repair
refused a tier whose orphaned entries agree with meta; an archive entry with an empty key failed in
LMDB, naming no frame; a deeply nested archive info was a traceback; commands run as root left a
root-owned lock.mdb or tiered_kv.lock in a user's tier.  The plain tests pin guarantees no tests/test_ops_*.py or test_review_ops.py test held (each fails if broken):
a SIGKILLed import (new or existing path), a Ctrl-C'd compact or export, read-only commands that
never create the TierManager lock, and archive frames with a valid frame checksum around a bad entry.

Deterministic: seeded content (test_ops_common.content), tmp_path directories, child processes driven
by hooks (no sleeps, no timing asserts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import xxhash
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from test_ops_common import (NS, PYTHON, REPO, ROW, build_env, cli, content, keys, load_bytes, open_manager, raw,
                             raw_all, raw_put, set_meta, snapshot, store_keys, token_of)
from tiered_kv.disk.format import FLAG_SLOT, lmdb_key, pack_header, parse_header, slot_bytes_for
from tiered_kv.tools import archive as A
from tiered_kv.tools import ops
from tiered_kv.disk.format import FORMAT_VERSION
from tiered_kv.tools.archive import _FILE_HDR, _SUM, ARCHIVE_MAGIC, ARCHIVE_VERSION, export_archive, pack_frame, pack_trailer


# ============================================================================ helpers
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + ((os.pathsep + env["PYTHONPATH"]) if env.get("PYTHONPATH") else "")
    return env


def _child(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", script, *args], capture_output=True, text=True, env=_child_env(),
                          cwd=str(REPO), timeout=120)


def _entry(key: bytes, ns: bytes = NS.encode(), row: int = ROW, token: int = 7, seq: int = 5) -> bytes:
    """A self-contained (inline) entry as export writes it."""
    payload = content(key, row)
    return pack_header(ns, key, uuid.UUID(int=token), payload, seq) + payload


def _archive(path: Path, values: list[bytes], ns: bytes = NS.encode(), bb: int = ROW, info_json: bytes = b"{}") -> Path:
    """An archive with valid file header, frame and trailer checksums around ``values`` (whatever they hold)."""
    head = _FILE_HDR.pack(ARCHIVE_MAGIC, ARCHIVE_VERSION, FORMAT_VERSION, 0, bb, 0.0, len(ns), len(info_json)) \
        + ns + info_json
    out = [head + _SUM.pack(xxhash.xxh3_64_intdigest(head))]
    digest = xxhash.xxh3_64()
    for i, v in enumerate(values):
        f = pack_frame(i, v)
        digest.update(f)
        out.append(f)
    out.append(pack_trailer(len(values), sum(map(len, values)), digest.intdigest()))
    path.write_bytes(b"".join(out))
    return path


def _frame_offset(path: Path, index: int) -> int:
    data = path.read_bytes()
    _m, _v, _f, _fl, _bb, _cr, ns_len, info_len = _FILE_HDR.unpack_from(data, 0)
    off = _FILE_HDR.size + ns_len + info_len + 8
    for _ in range(index):
        (length,) = struct.unpack_from("<I", data, off + 12)
        off += A.FRAME_OVERHEAD + length
    return off


def _small_map_tier(path: Path, ks: list[bytes]) -> Path:
    """A tier whose LMDB map is 256 KiB (a reader maps that much), written by a TierManager."""
    kv = torch.zeros((8, ROW), dtype=torch.uint8)
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=4 * ROW, disk_path=path, disk_capacity_bytes=64 * ROW,
                         disk_map_size_bytes=256 << 10)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    try:
        store_keys(mgr, kv, ks)
    finally:
        mgr.close()
    return path


def _flip_slot_byte(path: Path, key: bytes) -> None:
    """Damage ``key``'s payload in the slot file (its index record stays as it is)."""
    h = parse_header(raw(path, inline=False)[lmdb_key(key)])
    with open(path / "slots.tkv", "r+b") as f:
        off = h.slot * slot_bytes_for(ROW) + 10
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))


# The live writer of the tier: grows its map (16 MiB) and the data file past a 256 KiB reader's mapping.
GROW_WRITER = r"""
import lmdb, sys
env = lmdb.open(sys.argv[1], max_dbs=4, map_size=16 << 20)
meta = env.open_db(b"meta", create=False)
with env.begin(write=True) as t:
    t.put(b"scratch", b"x" * (4 << 20), db=meta)
with env.begin(write=True) as t:
    t.delete(b"scratch", db=meta)
env.close()
"""

# Runs a tiered-kv command; the writer above runs at the hook named by argv[3] (then the real function).
GROW_CHILD = r"""
import subprocess, sys
import tiered_kv.tools.archive as A
import tiered_kv.tools.ops as ops
from tiered_kv.tools.cli import main
writer, path, hook = sys.argv[1], sys.argv[2], sys.argv[3]
def grow():
    subprocess.run([sys.executable, "-c", writer, path], check=True)
if hook == "record_changed":            # an entry failed verification inside the scan's read transaction
    real = ops.record_changed
    def hooked(oe, lk, value):
        grow()
        return real(oe, lk, value)
    ops.record_changed = A.record_changed = hooked
else:                                   # between the meta read and the scan's transaction (none open)
    real_cm = ops.check_meta
    def hooked(meta, p):
        grow()
        return real_cm(meta, p)
    ops.check_meta = hooked
sys.exit(main(sys.argv[4:]))
"""


# ============================================================================ findings
@pytest.mark.parametrize("cmd", ["verify", "export"])
def test_a_read_only_scan_survives_a_live_writer_growing_the_map(cmd, tmp_path):
    """docs/operations.md: verify and export are safe beside a live TierManager, and a long read transaction
    makes the writer's file grow.  When the writer has grown its map past the reader's mapping and the scan
    meets an entry that fails verification, record_changed opens a second read transaction: MapResizedError,
    and OpenEnv.begin calls env.set_mapsize(0) -- which remaps the environment under the scan's still-open
    transaction and cursor (py-lmdb/LMDB: no transaction may be active).  The process dies with SIGSEGV.
    The entry is really corrupt (its record did not change): it must be reported as such."""
    path = _small_map_tier(tmp_path / "disk", keys(4))
    _flip_slot_byte(path, b"k0001")
    argv = (["verify", str(path), "--no-progress"] if cmd == "verify" else
            ["export", str(path), "--namespace", NS, str(tmp_path / "a.tkv"), "--no-progress"])
    r = _child(GROW_CHILD, GROW_WRITER, str(path), "record_changed", *argv)
    assert r.returncode == (1 if cmd == "verify" else 0), (r.returncode, r.stdout, r.stderr[-2000:])
    if cmd == "verify":
        assert "3 ok, 1 corrupt, 0 orphaned" in r.stdout, r.stdout
    else:
        assert "exported 3 entries" in r.stdout and "skipped 1 corrupt" in r.stdout, r.stdout


@pytest.mark.parametrize("value", [b'{"entries": 1' + b"0" * 400 + b"}", b"[" * 50000 + b"]" * 50000],
                         ids=["400-digit-number", "deeply-nested"])
def test_a_damaged_last_recovery_record_does_not_stop_inspect_or_verify(value, tmp_path, capsys):
    """docs/operations.md: a last_recovery record that is no recovery report is shown as
    ``unreadable record '...'``.  _read_meta (run by every command when it opens the tier) only catches
    ValueError: math.isfinite(10**400) raises OverflowError (inspect and verify exit 2 with a message that
    names no path), json.loads of deep nesting raises RecursionError (a traceback).  verify does not even
    need that record."""
    path = build_env(tmp_path / "disk", keys(2))
    set_meta(path, b"last_recovery", value)
    try:
        rc, out, err = cli(capsys, "inspect", str(path))
        rc2, out2, err2 = cli(capsys, "verify", str(path), "--no-progress")
    except RecursionError as exc:
        raise AssertionError(f"a command raised {exc!r}") from exc
    assert rc == 0, (rc, out, err)
    line = next(ln for ln in out.splitlines() if ln.startswith("last recovery"))
    assert "unreadable record" in line, line
    assert rc2 == 0 and "2 ok, 0 corrupt" in out2, (rc2, out2, err2)


def test_export_never_replaces_an_out_that_appeared_while_it_ran(tmp_path, capsys, monkeypatch):
    """docs/operations.md: OUT must not exist (exit 2, nothing changed).  The check is not atomic with the
    rename: a file created at OUT during the export (another export to the same name, an operator's copy)
    is silently replaced.  os.link(partial, OUT) refuses atomically."""
    src = build_env(tmp_path / "src", keys(3))
    out = tmp_path / "warm.tkv"
    real = A.pack_trailer

    def trailer_while_someone_writes_out(*a):
        out.write_bytes(b"someone else's file")
        return real(*a)

    monkeypatch.setattr(A, "pack_trailer", trailer_while_someone_writes_out)
    rc, o, err = cli(capsys, "export", str(src), "--namespace", NS, str(out), "--no-progress")
    assert out.read_bytes() == b"someone else's file", "export replaced a file it had not created"
    assert rc == 2 and "already exists" in err, (rc, o, err)
    assert not list(tmp_path.glob("warm.tkv.partial-*"))


def test_a_failed_import_never_removes_a_tier_that_appeared_before_it_took_the_lock(tmp_path, capsys, monkeypatch):
    """import into a new PATH creates the directory, then takes the lock; if a TierManager created (and
    closed) its tier there in between, import sees state 'existing' under the lock (and empties ``made``:
    'whoever holds the path now owns what is in it') -- but ``created`` still names the directory, so when
    the import then fails (here: the tier is of another namespace, exit 2), the except clause rmtree()s the
    other tier with all its entries."""
    src = build_env(tmp_path / "src", keys(3))
    arch = export_archive(src, NS, tmp_path / "a.tkv").out
    dst = tmp_path / "new" / "tier"
    real = A.hold_path

    @contextlib.contextmanager
    def tier_created_meanwhile(p):
        build_env(Path(p), keys(2, "own"), namespace="other|ns")   # a TierManager opened, wrote, closed
        with real(p):
            yield

    monkeypatch.setattr(A, "hold_path", tier_created_meanwhile)
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 2 and "namespace" in err, (rc, out, err)
    assert (dst / "data.mdb").exists(), "the failed import deleted a tier it had not written"
    mgr, kv = open_manager(dst, namespace="other|ns")
    try:
        for k in keys(2, "own"):
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


def test_repair_is_not_refused_as_damaged_meta_when_orphaned_entries_agree_with_meta(tmp_path, capsys):
    """docs/operations.md: the guard is for 'when *no* entry agrees with meta's namespace and block size
    (every problem is wrong_namespace or wrong_length)'.  Orphaned entries (written under a tombstoned
    token) pass verify_entry against meta -- they prove meta right -- but the guard only looks at
    ``rep.ok == 0`` and the corrupt list: three orphans and one foreign entry make --repair refuse with a
    false 'none of its 4 entries has meta's namespace', and nothing is reclaimed."""
    path = build_env(tmp_path / "disk", keys(3))
    for k in keys(3):
        raw_put(path, "tombs", token_of(path, k).bytes, k)
    raw_put(path, "blocks", lmdb_key(b"x0000"), _entry(b"x0000", ns=b"other|ns"))
    rc, out, err = cli(capsys, "verify", str(path), "--no-progress")
    assert rc == 1 and "0 ok, 1 corrupt, 3 orphaned" in out, (rc, out, err)
    rc, out, err = cli(capsys, "verify", "--repair", str(path), "--json", "--no-progress")
    assert rc == 0, (rc, out, err)
    assert json.loads(out)["removed"] == 4
    assert raw(path) == {}


def test_an_entry_with_an_empty_key_is_refused_by_the_verifying_pass_naming_its_frame(tmp_path, capsys):
    """No TierManager writes an empty key (checks.py refuses it), so such an entry is a bad archive:
    docs/operations.md says pass 1 verifies every frame before PATH is touched and the error names the
    bad frame's index and byte offset.  Here pass 1 passes, pass 2 puts frame 0, then LMDB refuses the
    empty key: 'BadValsizeError: mdb_get: MDB_BAD_VALSIZE ... (in PATH)'."""
    arch = _archive(tmp_path / "a.tkv", [_entry(b"k0000"), _entry(b"")])
    dst = build_env(tmp_path / "dst", keys(2, "own"))
    before = raw_all(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 2, (rc, out, err)
    assert raw_all(dst) == before
    assert f"frame 1 (offset {_frame_offset(arch, 1)})" in err, err


def test_an_archive_with_a_deeply_nested_info_is_not_a_traceback(tmp_path, capsys):
    """The file header's info is informative only (a bad one is taken as {}), and archives come from other
    nodes.  One whose info is 50,000 nested lists (within the 1 MiB limit, checksum valid) makes json.loads
    raise RecursionError, which nothing catches."""
    arch = _archive(tmp_path / "a.tkv", [_entry(b"k0000")], info_json=b"[" * 50000 + b"]" * 50000)
    dst = tmp_path / "dst"
    try:
        rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    except RecursionError as exc:
        raise AssertionError(f"import raised {exc!r}") from exc
    assert (rc == 0 and "imported 1 of 1" in out) or (rc == 2 and str(arch) in err and not dst.exists()), (rc, out, err)


@pytest.mark.skipif(os.geteuid() != 0, reason="the defect is a file created as root in another user's tier")
@pytest.mark.parametrize("cmd", ["inspect", "verify", "export", "compact"])
def test_a_command_run_as_root_leaves_no_root_owned_file_in_a_users_tier(cmd, tmp_path, capsys):
    """A tier restored from a backup (or copied with data.mdb and slots.tkv only) has no lock.mdb.  LMDB
    creates it on the first open, read-only ones included, as the user running the command (0644): run as
    root, that is a root-owned lock file, which the serving user's TierManager must open read-write
    (lmdb.open, lock.take): it fails with 'Permission denied'.  docs/operations.md tells operators that
    compact may be run as root 'so that the TierManager can still open it' (it fixes data.mdb's owner, not
    the lock files'), and read-only commands are not meant to change what a TierManager can open."""
    owner = 4242
    path = build_env(tmp_path / "disk", keys(3))
    (path / "lock.mdb").unlink()
    if cmd == "compact":
        (path / "tiered_kv.lock").unlink()
    for f in [path, *path.iterdir()]:
        os.chown(f, owner, owner)
    args = {"inspect": ["inspect", str(path)], "verify": ["verify", str(path), "--no-progress"],
            "export": ["export", str(path), "--namespace", NS, str(tmp_path / "a.tkv"), "--no-progress"],
            "compact": ["compact", str(path), "--no-progress"]}[cmd]
    rc, out, err = cli(capsys, *args)
    assert rc == 0, (rc, out, err)
    owners = {f.name: (f.stat().st_uid, f.stat().st_gid) for f in path.iterdir()}
    assert all(o == (owner, owner) for o in owners.values()), owners


# ============================================================================ pinned guarantees
def test_a_read_only_scan_adopts_a_map_grown_before_its_transaction(tmp_path):
    """The legitimate use of OpenEnv.begin's retry: the live writer grew its map past this reader's
    mapping after the open and before the scan's transaction (no transaction open): MapResizedError is
    adopted, and verify reads every entry.  Without the retry verify fails (exit 2)."""
    path = _small_map_tier(tmp_path / "disk", keys(4))
    r = _child(GROW_CHILD, GROW_WRITER, str(path), "check_meta", "verify", str(path), "--no-progress")
    assert r.returncode == 0 and "4 ok, 0 corrupt, 0 orphaned" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


KILL_IMPORT = r"""
import os, signal, sys
import tiered_kv.tools.archive as A
from tiered_kv.tools.cli import main
real, calls = A.lmdb_key, []
def lmdb_key(key):                      # called once per frame by the write pass: die after 3 puts
    calls.append(key)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(key)
A.lmdb_key = lmdb_key
sys.exit(main(["import", sys.argv[1], sys.argv[2], "--no-progress"]))
"""


@pytest.mark.parametrize("into", ["new", "existing"])
def test_an_import_killed_inside_its_write_pass_publishes_nothing_and_can_be_rerun(into, tmp_path, capsys):
    """SIGKILL (OOM, kill -9) in the middle of pass 2, after some puts: the one write transaction never
    commits.  An existing tier keeps every sub-database as it was and a TierManager serves its own blocks
    and none of the archive's; a new path (which the killed import cannot clean up) is left in a state that
    a rerun of the same import accepts, and then serves the archive."""
    src = build_env(tmp_path / "src", keys(6, "a"))
    arch = export_archive(src, NS, tmp_path / "a.tkv").out
    dst = tmp_path / "dst" if into == "new" else build_env(tmp_path / "dst", keys(2, "own"))
    before = raw_all(dst) if into == "existing" else None
    r = _child(KILL_IMPORT, str(dst), arch)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-2000:])
    if into == "existing":
        assert raw_all(dst) == before
        mgr, kv = open_manager(dst)
        try:
            for k in keys(2, "own"):
                assert load_bytes(mgr, kv, k) == content(k)
            assert all(mgr.lookup([k]) == 0 for k in keys(6, "a"))
        finally:
            mgr.close()
    rc, out, err = cli(capsys, "import", str(dst), arch, "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["imported"] == 6, (rc, out, err)
    mgr, kv = open_manager(dst)
    try:
        for k in keys(6, "a") + (keys(2, "own") if into == "existing" else []):
            assert load_bytes(mgr, kv, k) == content(k), k
    finally:
        mgr.close()


def test_compact_interrupted_before_the_swap_leaves_the_tier_as_it_was_and_unlocked(tmp_path):
    """Ctrl-C while compact copies (the KeyboardInterrupt lands in the main thread's wait loop): the copy
    thread is joined, the temporary directory removed, data.mdb byte for byte as it was, and the path lock
    released -- a TierManager opens the tier at once and serves it."""
    path = build_env(tmp_path / "disk", keys(6))
    for k in keys(6)[::2]:
        raw_put(path, "blocks", lmdb_key(k), None)
    data0 = (path / "data.mdb").read_bytes()

    def ctrl_c(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ops.compact(path, progress=ctrl_c)
    assert (path / "data.mdb").read_bytes() == data0
    assert not list(path.glob(ops.COMPACT_TMP_PREFIX + "*"))
    mgr, kv = open_manager(path)
    try:
        for k in keys(6)[1::2]:
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


def test_export_interrupted_before_the_rename_leaves_no_out_and_no_partial_file(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the frames were written, before the rename: no file named OUT, no OUT.partial-PID,
    the tier untouched (exit 130)."""
    src = build_env(tmp_path / "src", keys(3))
    before = snapshot(src)

    def ctrl_c(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(A, "pack_trailer", ctrl_c)
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(tmp_path / "a.tkv"), "--no-progress")
    assert rc == 130, (rc, out, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert snapshot(src) == before


def test_read_only_commands_never_create_the_tiermanager_lock(tmp_path, capsys):
    """docs/operations.md: read-only commands never take (or probe) tiered_kv.lock -- a probe would create
    it (lock.take opens it O_CREAT) and could make a TierManager starting at that moment fail."""
    path = build_env(tmp_path / "disk", keys(3))
    (path / "tiered_kv.lock").unlink()
    for args in (["inspect", str(path), "--json"], ["verify", str(path), "--no-progress"],
                 ["export", str(path), "--namespace", NS, str(tmp_path / "a.tkv"), "--no-progress"]):
        rc, out, err = cli(capsys, *args)
        assert rc == 0, (args, out, err)
        assert not (path / "tiered_kv.lock").exists(), f"{args[0]} created tiered_kv.lock"


def _slot_entry(key: bytes) -> bytes:
    payload = content(key)
    return pack_header(NS.encode(), key, uuid.UUID(int=7), payload, 5, FLAG_SLOT) + struct.pack("<Q", 3)


def _lying_length(key: bytes) -> bytes:
    v = bytearray(_entry(key))
    struct.pack_into("<Q", v, 12, ROW - 8)        # the header's payload length, the bytes unchanged
    return bytes(v)


@pytest.mark.parametrize("bad,reason", [
    (lambda: _entry(b"k0001", ns=b"other|ns"), "wrong_namespace"),
    (lambda: _entry(b"k0001", row=ROW // 2), "wrong_length"),
    (lambda: _slot_entry(b"k0001"), "slot_entry"),
    (lambda: _lying_length(b"k0001"), "truncated"),
], ids=["other-namespace", "other-block-size", "slot-entry", "lying-length"])
def test_a_well_framed_frame_around_a_bad_entry_is_refused_and_publishes_nothing(bad, reason, tmp_path, capsys):
    """The frame checksum only says the frame arrived as written.  A frame written around an entry of
    another namespace or block size, a slot entry (no payload), or an entry whose header length lies
    must be refused by the entry check (verify_entry against the archive's namespace and block size),
    naming the frame, before anything is published -- not even frame 0."""
    arch = _archive(tmp_path / "a.tkv", [_entry(b"k0000"), bad(), _entry(b"k0002")])
    dst = build_env(tmp_path / "dst", keys(2, "own"))
    before, snap = raw_all(dst), snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 2, (rc, out, err)
    assert f"frame 1 (offset {_frame_offset(arch, 1)}): its entry fails verification ({reason}" in err, err
    assert raw_all(dst) == before and snapshot(dst) == snap
    rc, out, err = cli(capsys, "import", str(tmp_path / "new"), str(arch), "--no-progress")
    assert rc == 2 and not (tmp_path / "new").exists(), (rc, out, err)
