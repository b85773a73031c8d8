"""Adversarial review of the operator commands (tools/ops.py, ops_cli.py, archive.py): what it proved
wrong, each pinned by a test that failed before its fix, and guarantees no tests/test_ops_*.py test held.

* export carries each entry's last use (the newer of its write and its promote's touch record), so an
  imported tier keeps the source's LRU order -- also for an inline entry promoted since its import;
* inspect shows a damaged ``created`` / ``last_recovery`` meta record as unreadable text, never a traceback;
* ``verify --repair`` removes nothing when no entry agrees with meta (a damaged meta), and still removes
  entries that are each bad on their own;
* held: digested (over-long) keys through every command; an archive altered between import's two passes.

Deterministic: seeded content (test_ops_common.content), tmp_path directories, no sleeps, no timing asserts.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from test_ops_archive import _frame_offsets
from test_ops_common import (NS, build_env, cli, content, keys, load_bytes, open_manager, raw, raw_all, raw_put,
                             set_meta, snapshot, store_keys)
from tiered_kv.disk.format import HEADER_SIZE, parse_header
from tiered_kv.tools.archive import FRAME_OVERHEAD, export_archive, import_archive

HOT = b"k0000"


def _recency(path: Path) -> dict[bytes, int]:
    """Block key -> what recovery orders the LRU by: the newer of the header's write sequence and
    the entry's touch record (tiered_kv/disk/recovery.py)."""
    touch = {k: struct.unpack("<Q", v)[0] for k, v in raw(path, "touch").items() if len(v) == 8}
    out = {}
    for lk, v in raw(path).items():
        h = parse_header(v)
        out[h.key] = max(h.seq, touch.get(lk, 0))
    return out


def _survivors(path: Path, ks: list[bytes], disk_slots: int) -> set[bytes]:
    """The keys a TierManager with room for ``disk_slots`` blocks still holds after it opened ``path``."""
    mgr, _kv = open_manager(path, disk_slots=disk_slots, host_slots=2)
    try:
        return {k for k in ks if mgr.lookup([k]) == 1}
    finally:
        mgr.close()


@pytest.fixture(scope="module")
def hot_source(tmp_path_factory):
    """A tier of 8 blocks written k0000..k0007, then k0000 promoted from disk (so it is the most
    recently used).  Checked here (a fixture failure is an error, never an xfail): the touch record
    exists, and a TierManager with room for 4 blocks reopening a plain copy keeps k0000."""
    base = tmp_path_factory.mktemp("hot")
    src = base / "src"
    ks = keys(8)
    mgr, kv = open_manager(src, host_slots=2)
    try:
        store_keys(mgr, kv, ks)
        assert load_bytes(mgr, kv, HOT) == content(HOT)       # host holds 2 blocks: this one came from disk
        assert mgr.flush(timeout=30) is True
    finally:
        mgr.close()
    rec = _recency(src)
    assert max(rec, key=rec.__getitem__) == HOT, rec          # the promote's touch record made it the newest
    copy = base / "copy"
    shutil.copytree(src, copy)
    assert HOT in _survivors(copy, ks, disk_slots=4)
    return src, ks


# ============================================================================ findings
def test_export_import_keeps_the_recency_of_promoted_entries(hot_source, tmp_path):
    """docs/operations.md: entries keep their source sequence "so the destination's LRU orders imported
    entries by their age on the source node".  On the source a promoted block's recency is its touch
    record (recovery takes the newer of seq and touch); export carries only the header's write seq, so
    the block the source used last is the oldest one on the destination, and a node pre-warmed with
    less disk than the source evicts exactly the hot blocks it was warmed for."""
    src, ks = hot_source
    rep = export_archive(src, NS, tmp_path / "warm.tkv")
    assert rep.frames == len(ks)
    dst = tmp_path / "dst"
    assert import_archive(dst, tmp_path / "warm.tkv").imported == len(ks)
    rec = _recency(dst)
    assert max(rec, key=rec.__getitem__) == HOT, f"recency after import: {rec} (source: {_recency(src)})"
    assert HOT in _survivors(dst, ks, disk_slots=4), "the pre-warmed node evicted the source's hottest block"


@pytest.mark.parametrize("record,value", [
    (b"created", b"inf"), (b"created", b"nan"), (b"created", b"-1"), (b"created", b"1e300"), (b"created", b"x"),
    (b"last_recovery", b"[1]"), (b"last_recovery", b'{"at": "x"}'), (b"last_recovery", b'{"seconds": "y"}'),
    (b"last_recovery", b'{"at": 1e300}'), (b"last_recovery", b"{bad"),
])
def test_inspect_text_shows_a_damaged_meta_record_as_unreadable(record, value, tmp_path, capsys):
    """inspect is the command an operator runs on a damaged tier: a meta record that is no date (``created``)
    or no recovery report (``last_recovery``) is shown as the unreadable text it is, the rest as usual --
    never a traceback (``datetime.fromtimestamp(inf)`` raised OverflowError, ``[1].get`` AttributeError)."""
    path = build_env(tmp_path / "disk", keys(2))
    set_meta(path, record, value)
    try:
        rc, out, err = cli(capsys, "inspect", str(path))
    except Exception as exc:   # noqa: BLE001 - what escapes the CLI is the defect
        raise AssertionError(f"inspect raised {exc!r} for meta {record!r}={value!r}") from exc
    assert rc == 0 and "namespace" in out and "Traceback" not in err, (rc, out, err)
    line = next(ln for ln in out.splitlines() if ln.startswith("created" if record == b"created" else "last recovery"))
    assert "unreadable record" in line and value.decode() in line, line


# ============================================================================ pinned guarantees
def test_digested_long_keys_round_trip_through_verify_export_import_and_are_served(tmp_path, capsys):
    """Keys longer than the LMDB key limit are stored under a digest (format.lmdb_key).  Not covered by
    tests/test_ops_*: verify must find them ok (and --repair remove none), export/import must carry them
    byte for byte, and a TierManager on the imported tier must serve their bytes."""
    ks = [b"L" * 600 + b"%02d" % i for i in range(3)] + [b"s" * 480, b"short"]   # 480: the last undigested
    src = build_env(tmp_path / "src", ks)
    rc, out, err = cli(capsys, "verify", str(src), "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["ok"] == len(ks), (out, err)
    rc, out, err = cli(capsys, "export", str(src), "--namespace", NS, str(tmp_path / "a.tkv"), "--json",
                       "--no-progress")
    assert rc == 0 and json.loads(out)["frames"] == len(ks), (out, err)
    dst = tmp_path / "dst"
    rc, out, err = cli(capsys, "import", str(dst), str(tmp_path / "a.tkv"), "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["imported"] == len(ks), (out, err)
    assert raw(dst) == raw(src)
    rc, out, err = cli(capsys, "verify", str(dst), "--repair", "--json", "--no-progress")
    assert rc == 0 and json.loads(out)["removed"] == 0, (out, err)
    mgr, kv = open_manager(dst)
    try:
        for k in ks:
            assert load_bytes(mgr, kv, k) == content(k), k[-8:]
    finally:
        mgr.close()


def test_an_archive_altered_between_the_two_passes_publishes_nothing_into_an_existing_tier(tmp_path, capsys,
                                                                                         monkeypatch):
    """Pass 1 accepted the archive; a frame in the middle changes before pass 2 (shared storage, a
    concurrent copy).  Pass 2 has already put the frames before it into its write transaction when it
    finds the bad one: it must abort (all or nothing), name the frame, leave the tier byte for byte as
    it was, and a TierManager must still serve the local blocks.  (The existing tests damage archives
    before pass 1, which stops before any put.)"""
    import tiered_kv.tools.archive as A

    src = build_env(tmp_path / "src", keys(6, "a"))
    arch = tmp_path / "a.tkv"
    export_archive(src, NS, arch)
    dst = build_env(tmp_path / "dst", keys(2, "own"))
    before, snap = raw_all(dst), snapshot(dst)
    offs = _frame_offsets(arch.read_bytes())
    real_scan = A._scan   # import's pass 1

    async def scan_then_alter(archive, progress=None):
        res = await real_scan(archive, progress)
        data = bytearray(Path(archive).read_bytes())
        data[offs[4] + FRAME_OVERHEAD + 200] ^= 0x01          # frame 4's value; frames 0-3 stay good
        Path(archive).write_bytes(bytes(data))
        return res

    monkeypatch.setattr(A, "_scan", scan_then_alter)
    rc, out, err = cli(capsys, "import", str(dst), str(arch), "--no-progress")
    assert rc == 2, (out, err)
    assert f"frame 4 (offset {offs[4]}) is corrupt: frame checksum mismatch" in err, err
    assert raw_all(dst) == before and snapshot(dst) == snap
    mgr, kv = open_manager(dst)
    try:
        for k in keys(2, "own"):
            assert load_bytes(mgr, kv, k) == content(k)
        assert mgr.lookup([keys(6, "a")[0]]) == 0
    finally:
        mgr.close()


def test_an_inline_entry_promoted_since_its_import_carries_that_recency_to_the_next_export(hot_source, tmp_path):
    """Imported entries are inline (header + bytes in LMDB).  Promoted on the node they were imported to,
    one of them is its newest: exported again, that recency goes with it (the inline entry re-packed)."""
    src, ks = hot_source
    assert import_archive(tmp_path / "mid", export_archive(src, NS, tmp_path / "a.tkv").out).imported == len(ks)
    cold = ks[5]
    mgr, kv = open_manager(tmp_path / "mid", host_slots=2)
    try:
        assert load_bytes(mgr, kv, cold) == content(cold)
        assert mgr.flush(timeout=30) is True
    finally:
        mgr.close()
    rec = _recency(tmp_path / "mid")
    assert max(rec, key=rec.__getitem__) == cold, rec
    export_archive(tmp_path / "mid", NS, tmp_path / "b.tkv")
    assert import_archive(tmp_path / "dst", tmp_path / "b.tkv").imported == len(ks)
    rec = _recency(tmp_path / "dst")
    assert max(rec, key=rec.__getitem__) == cold, rec
    assert cold in _survivors(tmp_path / "dst", ks, disk_slots=4)


@pytest.mark.parametrize("record,value", [(b"block_bytes", b"6144"), (b"namespace", b"another|model")])
def test_repair_removes_nothing_when_no_entry_agrees_with_meta(record, value, tmp_path, capsys):
    """A damaged meta record (another block size or namespace) makes every good entry look foreign; a
    TierManager refuses such a path, and ``verify --repair`` would have emptied the tier.  It refuses
    instead (exit 2, naming meta), and leaves every byte as it was; plain ``verify`` still lists them."""
    path = build_env(tmp_path / "disk", keys(3))
    set_meta(path, record, value)
    before = snapshot(path)
    rc, out, err = cli(capsys, "verify", "--repair", str(path))
    assert rc == 2 and "meta" in err and "nothing was removed" in err, (rc, out, err)
    assert snapshot(path) == before
    rc, out, err = cli(capsys, "verify", str(path))
    assert rc != 0 and ("wrong_length" in out + err or "wrong_namespace" in out + err), (rc, out, err)


def test_repair_still_removes_every_entry_when_every_one_is_damaged_itself(tmp_path, capsys):
    """The guard above is for entries that disagree with meta only: entries that are each bad on their own
    (a wrong checksum) are removed even when none is left."""
    path = build_env(tmp_path / "disk", keys(3))
    for lk, v in raw(path, inline=False).items():
        raw_put(path, "blocks", lk, v[:HEADER_SIZE - 1] + bytes([v[HEADER_SIZE - 1] ^ 1]) + v[HEADER_SIZE:])
    rc, out, err = cli(capsys, "verify", "--repair", str(path))
    assert rc == 0 and not raw(path, inline=False), (rc, out, err)


@pytest.mark.parametrize("cmd", ["verify", "export"])
def test_an_io_error_on_a_descriptor_names_the_tier(cmd, tmp_path, capsys):
    """A slot file that is a directory fails its reads with EISDIR on a descriptor, whose error names no
    file: the one-line error names the tier's path instead (exit 2, no traceback)."""
    path = build_env(tmp_path / "disk", keys(2))
    slots = path / "slots.tkv"
    slots.unlink()
    slots.mkdir()
    args = [cmd, str(path)] + (["--namespace", NS, str(tmp_path / "out.tkv")] if cmd == "export" else [])
    rc, out, err = cli(capsys, *args)
    assert rc == 2 and str(path) in err and "Traceback" not in err, (rc, out, err)
